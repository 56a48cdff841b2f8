"""parity.py's trainer harness for ``fp8-blockwise`` with one field of the recipe changed.

An experiment, not an API: the trainer builds FP8 layers from the named recipe, so this script
edits the ``blockwise`` entry of the recipe table in this process before training. Prints the final
validation loss per seed; compare with ``benchmarks/parity.py --modes bf16-mixed --seed S``.

    python benchmarks/fp8_parity_knob.py fp32-wgrad 0,1,2
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import parity  # noqa: E402

from mixprec.formats import fp8_config as fp8config  # noqa: E402

KNOBS = {"none": {}, "fp32-wgrad": {"high_precision_wgrad": True}, "e5m2-grads": {"format": "hybrid"},
         "pow2-scales": {"power_of_two_scales": True},
         "1x32-tiles": {"activation_block": (1, 32), "weight_block": (32, 32)}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("knob", choices=sorted(KNOBS))
    p.add_argument("seeds", help="comma-separated, e.g. 0,1,2")
    p.add_argument("--steps", type=int, default=1000)
    a = p.parse_args()
    fp8config._RECIPE_FIELDS["blockwise"] = {**fp8config._RECIPE_FIELDS["blockwise"], **KNOBS[a.knob]}
    for s in (int(x) for x in a.seeds.split(",")):
        args = argparse.Namespace(model="tiny", steps=a.steps, batch=8, seq=64, lr=3e-3,
                                  eval_batches=40, seed=s)
        with tempfile.TemporaryDirectory() as root:
            r = parity.run_mode("fp8-blockwise", args, root)
        print(f"{a.knob} seed {s}: {r['val_loss']:.4f}", flush=True)


if __name__ == "__main__":
    main()
