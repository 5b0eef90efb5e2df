"""Max |logit diff| of Sluice on each stored weight format against transformers on the dequantized
twin, in fp64 (the oracle ``tests/models/test_weight_formats.py`` asserts for linear-attention
families) and in fp32, and transformers' own fp32-to-fp64 gap, on the registry's tiny models
(the numbers of docs/families.md's formats table). Deterministic: no timing.

    PYTHONPATH=src python benchmarks/weight_format_errors.py [--families qwen4_exp glm5_next]
        [--json benchmarks/results/weight-format-errors.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import sluice  # noqa: F401  (before torch: it sets OpenMP's wait policy)
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "models")]

KINDS = ("fp8", "ct-fp8", "ct-fp8-block", "int4")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=["qwen4_exp", "glm5_next"])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import test_weight_formats as tw
    from families import FamilyModels, reference

    models = FamilyModels(Path(tempfile.mkdtemp()))
    rows = []
    for family in args.families:
        for kind in KINDS:
            path, twin = models.hf(family, kind), models.reference_path(family, kind)
            ref = reference(twin)
            ids, ref_out = tw._decisive(ref)
            with torch.no_grad():
                r32 = ref(ids[None]).logits[0]
            r64 = reference(twin, dtype=torch.float64, experts_implementation="eager")
            with torch.no_grad():
                r64 = r64(ids[None]).logits[0]
            with sluice.load(path, memory=tw.MEMORY, progress=False) as eng:
                got = eng.forward(ids)
                tokens = eng.generate(ids.tolist(), max_new_tokens=tw.N_NEW, ignore_eos=True, speculate=False).token_ids

            def diff(a, b):
                return (a.double() - b.double()).abs().max().item()

            row = dict(family=family, kind=kind, vs_fp64=diff(got, r64), vs_fp32=diff(got, r32),
                       transformers_fp32_vs_fp64=diff(r32, r64), max_abs_logit=r64.abs().max().item(),
                       greedy_equal=tokens == ref_out[len(ids):].tolist())
            rows.append(row)
            print(f"{family:10s} {kind:13s} vs fp64 {row['vs_fp64']:.2e}  vs fp32 {row['vs_fp32']:.2e}  "
                  f"transformers fp32-fp64 {row['transformers_fp32_vs_fp64']:.2e}  greedy equal "
                  f"{row['greedy_equal']}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(dict(command=" ".join(sys.argv), rows=rows), indent=1))


if __name__ == "__main__":
    main()
