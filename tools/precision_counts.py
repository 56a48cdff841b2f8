"""The counts issue #23 asks for, reproducible: ``python tools/precision_counts.py [ROOT] [--visits]``.

* **rule branches**: files outside the decider (``mixprec/precision/``) whose code decides a
  precision rule itself instead of asking the rule book / the per-layer table: reading the
  ``keep_in_fp32`` tag, testing for a norm by class, or for a gate/router by name (the regexes in
  :data:`RULES`; writing the tag, declaring it on a class or mentioning it in prose is not a branch);
* **import circles** and **upward imports**: ``tests/test_layers.py``'s own checks;
* **files visited** (``--visits``): distinct mixprec files whose Python functions run while
  ``sys.setprofile`` watches one ``fit(Transformer tiny, precision="bf16-true", max_steps=1)``
  (the whole fit, run folder included), and the distinct upward call edges among them.

``ROOT`` is a checkout's directory holding ``mixprec/`` (default: this one), so an older commit
can be measured from ``git archive <commit> mixprec tests | tar -x -C DIR``.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

RULES = {
    "tag read": re.compile(r"""getattr\([^)]*["']keep_in_fp32["']|\.keep_in_fp32\b(?!\s*=[^=])"""),
    "norm by class": re.compile(r"isinstance\([^)]*(LayerNorm|RMSNorm|_NORM_TYPES|GroupNorm|BatchNorm)"),
    "gate by name": re.compile(r"""["'](gate|router|gating|gate_network)["']\s*(in|==)|"""
                               r"""(endswith|startswith)\(\s*\(?["'](Gate|Router|gate|router)"""),
}
DECIDER = "mixprec/precision/"
_DOCS = re.compile(r'("""|\'\'\')(.*?)\1', re.S)


def rule_branches(root: Path) -> dict[str, list[str]]:
    """``{file: [matched line, ...]}`` for files outside the decider that branch on a rule."""
    out: dict[str, list[str]] = {}
    for path in sorted((root / "mixprec").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(DECIDER):
            continue
        text = _DOCS.sub(lambda m: "\n" * m.group(0).count("\n"), path.read_text())  # prose out
        for n, line in enumerate(text.splitlines(), 1):
            code = line.split("#", 1)[0]
            for kind, rx in RULES.items():
                if rx.search(code):
                    out.setdefault(rel, []).append(f"{n}: {kind}: {line.strip()[:100]}")
    return out


def layer_counts(root: Path) -> tuple[int, int]:
    """(import circles beyond the allowed one, upward imports) by tests/test_layers.py's checks."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import test_layers as tl
    circles = [c for c in tl.import_circles(root / "mixprec")
               if tuple(c) not in getattr(tl, "ALLOWED_CIRCLES", set())]
    return len(circles), len(tl.violations(root / "mixprec"))


def visits() -> tuple[int, int, int]:
    """(files, rooms, upward call edges) while one bf16-true step of fit() runs (the mixprec that
    ``import mixprec`` finds). An upward call edge is a distinct (caller file, callee file) pair
    where a room calls into a room above it in tests/test_layers.py's order (a callback the
    caller was handed, a lazy import's function)."""
    import tempfile

    import torch
    import mixprec as mp
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_layers import ORDER
    pkg = Path(mp.__file__).parent

    def room(f: str) -> str | None:
        if not f.startswith(str(pkg)):
            return None
        parts = Path(f).relative_to(pkg).parts
        return parts[0] if len(parts) > 1 and parts[0] in ORDER else None

    torch.manual_seed(0)
    model = mp.Transformer.from_preset("tiny")
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 256, (2, 33), generator=g) for _ in range(2)]
    loader = [(x[:, :-1], x[:, 1:]) for x in data]
    seen: set[str] = set()
    upward: set[tuple[str, str]] = set()

    def prof(frame, event, arg):
        if event != "call":
            return
        f = frame.f_code.co_filename
        if not f.startswith(str(pkg)):
            return
        seen.add(f)
        back = frame.f_back
        caller = back.f_code.co_filename if back is not None else ""
        a, b = room(caller), room(f)
        if a and b and ORDER.index(b) > ORDER.index(a):
            upward.add((caller, f))

    with tempfile.TemporaryDirectory() as tmp:
        sys.setprofile(prof)
        try:
            mp.fit(model, loader, precision="bf16-true", max_steps=1, run_dir=tmp, progress=False,
                   ckpt_interval=0)
        finally:
            sys.setprofile(None)
    rooms = {Path(f).relative_to(pkg).parts[0] for f in seen}
    return len(seen), len(rooms), len(upward)


def main(argv: list[str]) -> None:
    root = Path(next((a for a in argv if not a.startswith("--")), Path(__file__).resolve().parents[1]))
    branches = rule_branches(root)
    print(f"files branching on a precision rule outside {DECIDER}: {len(branches)}")
    for rel, lines in branches.items():
        for line in lines:
            print(f"  {rel}:{line}")
    circles, upward = layer_counts(root)
    print(f"import circles (beyond the allowed one): {circles}; upward imports: {upward}")
    if "--visits" in argv:
        n, rooms, turns = visits()
        print(f"fit(tiny, bf16-true, max_steps=1): {n} mixprec files visited in {rooms} rooms; "
              f"{turns} upward call edges (caller file -> callee file in a room above)")


if __name__ == "__main__":
    main(sys.argv[1:])
