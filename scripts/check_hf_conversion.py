"""Check a Hugging Face checkpoint folder imports into Megatron with the same logits.

    .venv/bin/python scripts/check_hf_conversion.py --hf-dir DIR [--prompts "Hi" "2+2="]
        [--dtype fp32|bf16]
    torchrun --nproc-per-node 2 scripts/check_hf_conversion.py --hf-dir DIR --tp 2

Loads DIR with transformers (every rank, as the reference) and into the Megatron GPT on the
requested layout, then prints the parameter count and, per prompt, the max |logit
difference| and its 90th percentile over tokens. Prompts are tokenised with the folder's
tokenizer when it has one, else replaced by random token ids. Exits 1 when the max
difference exceeds --tolerance in fp32 (default 1e-3). In bf16 both sides round differently
(a few ulps of the largest logits) and an MoE token whose top-k flips can move by ~1, so
there the verdict is on the 90th percentile relative to max |logit| (default 0.05; a wrong
mapping is off by about 100%).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import megatron_multilora as mm  # first: it quiets megatron's CPU import notices
from megatron_multilora.models.hf_import import load_hf_model, load_hf_tokenizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-dir", required=True, help="Hugging Face model folder")
    p.add_argument("--prompts", nargs="+", default=DEFAULT_PROMPTS)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument(
        "--tp",
        type=int,
        default=int(os.environ.get("WORLD_SIZE", "1")),
        help="tensor-parallel size (default: the torchrun world size)",
    )
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    p.add_argument("--tolerance", type=float, default=None)
    return p.parse_args()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def prompt_ids(folder: str, prompts: list[str], vocab: int) -> tuple[list[torch.Tensor], str]:
    """One [1, s] id tensor per prompt, and where the ids came from. Without tokenizer files
    (AutoTokenizer may still build a default one from config.json) ids are random."""
    if any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES):
        tokenizer = load_hf_tokenizer(folder)
        ids = [torch.tensor([tokenizer(p)["input_ids"]], dtype=torch.long) for p in prompts]
        if all(0 < t.numel() and int(t.max()) < vocab for t in ids):
            return ids, "the folder's tokenizer"
    gen = torch.Generator().manual_seed(0)
    return (
        [torch.randint(0, vocab, (1, 8 + 4 * i), generator=gen) for i in range(len(prompts))],
        "random ids (no usable tokenizer in the folder)",
    )


def main() -> int:
    mm.support_megatron_here()
    args = parse_args()
    from transformers import AutoModelForCausalLM

    dtype = DTYPES[args.dtype]
    fp32 = args.dtype == "fp32"
    tolerance = args.tolerance if args.tolerance is not None else (1e-3 if fp32 else 0.05)
    mm.init_parallel(tensor_model_parallel_size=args.tp, expert_model_parallel_size=args.ep)
    rank0 = torch.distributed.get_rank() == 0
    say = print if rank0 else (lambda *a, **k: None)

    model, cfg = load_hf_model(args.hf_dir, params_dtype=dtype)
    hf_model = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=dtype).eval()
    megatron_params = _megatron_param_count(model)
    hf_params = sum(p.numel() for p in hf_model.parameters())
    say(
        f"{args.hf_dir}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_attention_heads} heads / {cfg.num_query_groups} KV groups, vocab "
        f"{cfg.vocab_size}, experts {cfg.num_moe_experts or 0}, dtype {args.dtype}, "
        f"TP={args.tp} EP={args.ep}"
    )
    say(f"parameters: transformers {hf_params:,}, Megatron {megatron_params:,}")

    ids_list, source = prompt_ids(args.hf_dir, args.prompts, cfg.vocab_size)
    say(f"prompts tokenised with {source}")
    worst = worst_p90_rel = 0.0
    with torch.no_grad():
        for prompt, ids in zip(args.prompts, ids_list):
            positions = torch.arange(ids.size(1))[None]
            got = model(ids, positions, None, runtime_gather_output=True).float()
            want = hf_model(ids).logits.float()
            per_token = (got - want).abs().amax(-1).flatten()
            diff, p90 = per_token.max().item(), per_token.quantile(0.9).item()
            same_top = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
            scale = max(want.abs().max().item(), 1e-6)
            worst, worst_p90_rel = max(worst, diff), max(worst_p90_rel, p90 / scale)
            say(
                f"  {prompt[:36]!r:40} tokens {ids.size(1):3d}  max |logit diff| {diff:.3e}  "
                f"p90 {p90:.3e}  (max |logit| {want.abs().max().item():.2f}, same argmax "
                f"{same_top:.0%})"
            )
    judged, what = (worst, "max") if fp32 else (worst_p90_rel, "p90 per-token / max |logit|")
    ok = judged <= tolerance
    say(
        f"{'OK' if ok else 'FAIL'}: max |logit diff| {worst:.3e}; judged on the {what} "
        f"difference: {judged:.3e} (tolerance {tolerance:g})"
    )
    mm.destroy_parallel(destroy_process_group=True)
    return 0 if ok else 1


def _megatron_param_count(model: torch.nn.Module) -> int:
    """Whole-model count: TP-split parameters summed over TP ranks, experts over EP ranks;
    a tied output layer counted once (as transformers does)."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    ep = parallel_state.get_expert_model_parallel_world_size()
    total = 0
    for name, p in model.named_parameters():
        n = p.numel()
        if ".experts." in name and "shared_experts" not in name:
            n *= ep
        elif getattr(p, "tensor_model_parallel", False):
            n *= tp
        total += n
    return total


if __name__ == "__main__":
    sys.exit(main())
