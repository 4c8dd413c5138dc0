"""Where a run's initial weights come from, as the engine reads them while it materializes each unit: a
state-dict / Lightning / safetensors source (``pretrained``, ``safetensors_io``) and LoRA adapters
initialised as peft would (``lora_init``). No optional extra is needed to import them."""
