"""HuggingFace integration (the optional ``[hf]`` / ``[peft]`` extras): causal LMs as layered modules,
HF directories out of a trained module or a checkpoint, peft adapters, generation.

Importing this package needs ``transformers``; nothing below it in the layers imports it."""
from snake_strategy.hf.export import export_hf, export_hf_checkpoint, module_weights
from snake_strategy.hf.lora import export_merged_hf, get_peft_model, save_adapter, trained_parameters
from snake_strategy.hf.model import HFCausalLM

__all__ = ["HFCausalLM", "export_hf", "export_hf_checkpoint", "export_merged_hf", "get_peft_model", "module_weights",
           "save_adapter", "trained_parameters"]
