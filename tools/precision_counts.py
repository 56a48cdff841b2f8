"""The counts issue #23 asks for, reproducible: ``python tools/precision_counts.py [ROOT] [--visits]``.

* **rule branches**: files outside the decider (``mixprec/precision/``) whose code decides a
  precision rule itself instead of asking the rule book / the per-layer table: reading the
  ``keep_in_fp32`` tag, testing for a norm by class, or for a gate/router by name (the regexes in
  :data:`RULES`; writing the tag, declaring it on a class or mentioning it in prose is not a branch);
* **import circles** and **upward imports**: ``tests/test_layers.py``'s own checks;
* **files visited** (``--visits``): distinct mixprec files whose Python functions run while
  ``sys.setprofile`` watches one ``fit(Transformer tiny, precision="bf16-true", max_steps=1)``
  (the whole fit, run folder included), and the distinct upward call edges among them;
  **during one step only**: the same, counted only inside the second ``Trainer.train_step`` of a
  ``max_steps=2`` fit (the path of a parameter through one step, after the first step's one-time
  work); ``--list`` prints those files and edges;
* **the room sequence of one** ``Precision.step`` (``--visits``): the rooms below ``precision/``
  whose functions run inside the second ``Precision.step`` of that fit, in the order they are
  entered, consecutive repeats collapsed (``precision/`` itself, which hands data between them,
  and files outside the rooms are left out), and the distinct call edges from ``amp/`` into
  ``optim/`` (:func:`step_rooms`).

``ROOT`` is a checkout's directory holding ``mixprec/`` (default: this one), so an older commit
can be measured from ``git archive <commit> mixprec tests | tar -x -C DIR``.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

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


def visits(step_only: bool = False) -> tuple[int, int, int, list[str], list[tuple[str, str]]]:
    """(files, rooms, upward call edges, the files, the edges) while one bf16-true ``fit()`` runs
    (the mixprec that ``import mixprec`` finds): the whole ``max_steps=1`` fit, or
    (``step_only``) only the second ``Trainer.train_step`` of a ``max_steps=2`` fit. An upward
    call edge is a distinct (caller file, callee file) pair where a room calls into a room above
    it in tests/test_layers.py's order (a callback the caller was handed, a lazy import's
    function)."""
    import tempfile

    import torch
    import mixprec as mp
    from mixprec.train.trainer import Trainer
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
    step_code = Trainer.train_step.__code__
    steps = {"entered": 0, "inside": not step_only}

    def prof(frame, event, arg):
        if step_only and frame.f_code is step_code:
            if event == "call":
                steps["entered"] += 1
                steps["inside"] = steps["entered"] == 2
            elif event == "return":
                steps["inside"] = False
        if event != "call" or not steps["inside"]:
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
            mp.fit(model, loader, precision="bf16-true", max_steps=2 if step_only else 1, run_dir=tmp,
                   progress=False, ckpt_interval=0)
        finally:
            sys.setprofile(None)
    rel = sorted(Path(f).relative_to(pkg).as_posix() for f in seen)
    rooms = {Path(f).parts[0] for f in rel}
    edges = sorted((Path(a).relative_to(pkg).as_posix(), Path(b).relative_to(pkg).as_posix())
                   for a, b in upward)
    return len(seen), len(rooms), len(upward), rel, edges


def step_rooms(step: Any, run: Any) -> tuple[list[str], list[tuple[str, str]]]:
    """(rooms entered in order, consecutive repeats collapsed; distinct (amp file, optim file) call
    edges) while ``run()`` runs, counted only inside calls whose code is ``step``'s
    (``Precision.step``). ``precision/`` is the conductor and is left out of the sequence, as are
    files outside the rooms of tests/test_layers.py's order."""
    import mixprec as mp
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_layers import ORDER
    pkg = str(Path(mp.__file__).parent)
    code = step.__code__
    rooms: list[str] = []
    edges: set[tuple[str, str]] = set()
    depth = [0]

    def room(f: str) -> str | None:
        if not f.startswith(pkg):
            return None
        parts = Path(f).relative_to(pkg).parts
        return parts[0] if len(parts) > 1 and parts[0] in ORDER else None

    def prof(frame, event, arg):
        if frame.f_code is code:
            depth[0] += 1 if event == "call" else -1 if event == "return" else 0
            return
        if event != "call" or depth[0] <= 0:
            return
        f = frame.f_code.co_filename
        r = room(f)
        if r is None or r == "precision":
            return
        if not rooms or rooms[-1] != r:
            rooms.append(r)
        back = frame.f_back
        caller = back.f_code.co_filename if back is not None else ""
        if r == "optim" and room(caller) == "amp":
            edges.add((Path(caller).relative_to(pkg).as_posix(), Path(f).relative_to(pkg).as_posix()))

    sys.setprofile(prof)
    try:
        run()
    finally:
        sys.setprofile(None)
    return rooms, sorted(edges)


def step_room_sequence() -> tuple[list[str], list[tuple[str, str]]]:
    """:func:`step_rooms` of the second ``Precision.step`` of ``fit(tiny, bf16-true, max_steps=2)``
    (split masters, the default; the first step's one-time work left out)."""
    import tempfile

    import torch
    import mixprec as mp
    from mixprec.precision.precision import Precision
    torch.manual_seed(0)
    model = mp.Transformer.from_preset("tiny")
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 256, (2, 33), generator=g) for _ in range(2)]
    loader = [(x[:, :-1], x[:, 1:]) for x in data]
    original = Precision.step
    calls = {"n": 0}
    out: dict[str, Any] = {}

    def second(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] != 2:
            return original(self, *args, **kwargs)
        box = {}
        out["rooms"], out["edges"] = step_rooms(
            original, lambda: box.setdefault("r", original(self, *args, **kwargs)))
        return box["r"]

    Precision.step = second
    try:
        with tempfile.TemporaryDirectory() as tmp:
            mp.fit(model, loader, precision="bf16-true", max_steps=2, run_dir=tmp, progress=False,
                   ckpt_interval=0)
    finally:
        Precision.step = original
    return out["rooms"], out["edges"]


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
        for step_only, what in ((False, "fit(tiny, bf16-true, max_steps=1)"),
                                (True, "during one step only (the 2nd train_step)")):
            n, rooms, turns, files, edges = visits(step_only)
            print(f"{what}: {n} mixprec files visited in {rooms} rooms; {turns} upward call edges "
                  "(caller file -> callee file in a room above)")
            if "--list" in argv:
                print("  files: " + ", ".join(files))
                for a, b in edges:
                    print(f"  upward: {a} -> {b}")
        rooms, amp_optim = step_room_sequence()
        print(f"one Precision.step (the 2nd, bf16-true): rooms entered {' -> '.join(rooms)}; "
              f"{len(amp_optim)} call edges amp/ -> optim/")
        if "--list" in argv:
            for a, b in amp_optim:
                print(f"  amp -> optim: {a} -> {b}")


if __name__ == "__main__":
    main(sys.argv[1:])
