"""The notebooks run top to bottom in a kernel of this interpreter and move bytes through the SSD."""
from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOK = NOTEBOOKS / "01_quickstart.ipynb"
# Names jupyter_client replaces with the running interpreter when it launches a kernel.
PORTABLE_PYTHONS = {"python", f"python{sys.version_info[0]}", f"python{sys.version_info[0]}.{sys.version_info[1]}"}


def kernel_for_this_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """'python3' when its kernel spec starts this interpreter; otherwise a spec installed under tmp_path."""
    try:
        argv0 = KernelSpecManager().get_kernel_spec("python3").argv[0]
        if argv0 in PORTABLE_PYTHONS or os.path.realpath(argv0) == os.path.realpath(sys.executable):
            return "python3"
    except NoSuchKernel:
        pass
    from ipykernel.kernelspec import install

    prefix = tmp_path / "jupyter-prefix"
    install(kernel_name="snake-test", prefix=str(prefix))  # its argv is sys.executable
    monkeypatch.setenv("JUPYTER_PATH", str(prefix / "share" / "jupyter"))
    return "snake-test"


def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    nb = _execute(NOTEBOOK, tmp_path, monkeypatch)
    summary_cell = _tagged(nb, "summary")
    printed = "".join(out.get("text", "") for out in summary_cell.outputs if out.output_type == "stream")
    assert "final train loss" in printed and "ssd/weights" in printed
    result = next(out for out in summary_cell.outputs if out.output_type == "execute_result")
    per_tier = ast.literal_eval(result.data["text/plain"])
    assert per_tier["ssd"] > 0, per_tier

    # The figure (loss curve + traffic bars) was drawn by the kernel's inline backend.
    assert any(out.output_type == "display_data" and "image/png" in out.get("data", {})
               for cell in nb.cells for out in cell.get("outputs", []))


def test_finetune_hf_notebook_runs(tmp_path, monkeypatch):
    """02: save_pretrained -> fine-tune from the directory with SSD weights -> validate -> export ->
    from_pretrained -> generate -> plot."""
    pytest.importorskip("transformers")
    nb = _execute(NOTEBOOKS / "02_finetune_hf.ipynb", tmp_path, monkeypatch)
    summary_cell = _tagged(nb, "summary")
    result = next(out for out in summary_cell.outputs if out.output_type == "execute_result")
    summary = ast.literal_eval(result.data["text/plain"])
    assert summary["reloaded_equal"] and summary["generate_equal"], summary
    assert summary["eval_ssd_read"] > 0 and summary["eval_written"] == 0, summary
    assert summary["final_train_loss"] < 5.5, summary  # from ln(256) = 5.55 at the random init
    assert any(out.output_type == "display_data" and "image/png" in out.get("data", {})
               for cell in nb.cells for out in cell.get("outputs", []))


def _execute(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The notebook at ``path``, run top to bottom in a kernel of this interpreter; no cell may fail."""
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=300, kernel_name=kernel_for_this_python(tmp_path, monkeypatch),
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    errors = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
              if out.output_type == "error"]
    assert not errors, errors
    return nb


def _tagged(nb, tag: str):
    return next(cell for cell in nb.cells if tag in cell.metadata.get("tags", []))


def _printed(cell) -> str:
    return "".join(out.get("text", "") for out in cell.outputs if out.output_type == "stream")


def _has_figure(cell) -> bool:
    return any(out.output_type == "display_data" and "image/png" in out.get("data", {}) for out in cell.outputs)


def test_plan_and_timeline_notebook_runs(tmp_path, monkeypatch):
    """03: size a model for a machine with the planner, then a tiny run's measured timeline (its trace file)
    next to the prediction."""
    nb = _execute(NOTEBOOKS / "03_plan_and_timeline.ipynb", tmp_path, monkeypatch)
    # The sizing: the smallest budget is refused with the planner's reason, the larger ones get a placement.
    sizing = _printed(_tagged(nb, "plan"))
    assert "does not fit" in sizing and "cannot hold the working set" in sizing and "fits, host" in sizing
    predictions = _tagged(nb, "predict")
    assert "vertical" in _printed(predictions) and "horizontal" in _printed(predictions)
    assert _has_figure(predictions) and _has_figure(_tagged(nb, "timeline"))
    # The measured step, from the trace file: every resource had work in it.
    result = next(out for out in _tagged(nb, "breakdown").outputs if out.output_type == "execute_result")
    busy = ast.literal_eval(result.data["text/plain"])
    assert busy["step"] > 0 and busy["compute"] > 0 and busy["ssd"] > 0 and busy["optimizer"] > 0, busy
