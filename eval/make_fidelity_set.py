"""Write the fidelity gate's calibration set: passages of invented facts and questions on them.

    python -m eval.make_fidelity_set [--seed 2026] [--out ragkv/fidelity/calibration_set.json]

Every entity (person, town, company, ship, novel, lake) is invented from random syllables, so no
answer can come from the model's memory and no passage is in an evaluation split or the demo. Each
passage states four facts about one entity in 55-85 tokens; a question asks for one fact, and its
prompt holds the answer-bearing passage among distractors of the same kinds: 4 passages ("short",
~450 tokens, the held-out check's shape) or 6 ("long", ~500 tokens). The output is deterministic
for a seed; the package ships the file this writes (``ragkv calibrate`` reads it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ragkv.facts import build

__all__ = ["build", "main"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--short", type=int, default=32, help="questions over 4 passages")
    ap.add_argument("--long", type=int, default=16, help="questions over --long-passages passages")
    ap.add_argument("--long-passages", type=int, default=6)
    ap.add_argument(
        "--out", default=str(Path(__file__).resolve().parents[1] / "ragkv/fidelity/calibration_set.json")
    )
    args = ap.parse_args(argv)
    data = build(args.seed, args.short, args.long, args.long_passages)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    print(
        json.dumps({"out": args.out, "passages": len(data["passages"]), "questions": len(data["questions"])})
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
