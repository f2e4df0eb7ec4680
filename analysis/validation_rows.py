"""The validation sweep's rows (issue 17, part 1): every method with a real drafter × its natural trees ×
workloads × temperature, the invalid combinations left out with a reason, and a resumable driver.

Hydra's sweeper takes cartesian products and cannot leave a combination out, so the driver enumerates the
valid rows here and runs each as one ``run.py experiment=validation ...`` process (analysis never imports
methods/ or run.py: layering), into ``<out>/<row id>/`` — a Hydra run dir that analysis.load reads. A row
whose metrics.json exists is skipped, so an interrupted sweep resumes; a row that fails leaves failed.json
(what analysis.sweep reads) and the sweep goes on. Rows come in priority order: every method on its natural
tree first, then the other workloads, then the other trees, then temperature 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from analysis.sweep import FAILED, completed
from specsim.io import atomic_write_json

ROW_FILE = "validation_row.json"  # the row's own description, beside metrics.json
CLAIM = ".claim"  # the pid of the driver running the row
WORKLOADS = ("code", "prose", "grounded")
TEMPERATURES = (0.0, 1.0)
SEQUOIA_BUDGETS = (8, 32)  # two Sequoia trees per tree-capable drafter (t(32) ≈ 1.5 t(1) on this CPU)
NATURAL = "natural"  # the tree the method preset picks
# method preset → the trees it is swept on (NATURAL first). Drafters that only draft chains (layerskip,
# draft_verify, mtp under sampling, online's Leviathan chain) or shape their own tree (lookahead's pool,
# staged's spine, specinfer's merged tree, EAGLE-2/3's dynamic tree) keep their natural one; EAGLE-3 is
# also swept on a chain (its head drafts any static tree).
TREES: dict[str, tuple[str, ...]] = {
    "autoregressive": (NATURAL,),
    "vanilla": (NATURAL,),  # a chain (tree=chain)
    "sequoia": tuple(f"sequoia{b}" for b in SEQUOIA_BUDGETS),  # the draft model on Sequoia's trees
    "prompt_lookup": (NATURAL,),
    "medusa": (NATURAL, "chain", *(f"sequoia{b}" for b in SEQUOIA_BUDGETS)),
    "eagle": (NATURAL, "chain", *(f"sequoia{b}" for b in SEQUOIA_BUDGETS)),
    "eagle2": (NATURAL,),
    "eagle3": (NATURAL, "chain"),
    "lookahead": (NATURAL,),
    "staged": (NATURAL,),
    "specinfer": (NATURAL,),
    "online": (NATURAL,),
    "layerskip": (NATURAL,),
    "draft_verify": (NATURAL,),
    "mtp": (NATURAL,),
}
# Combinations left out on purpose, with the reason (docs/validation.md lists them).
EXCLUDED: dict[tuple[str, str], str] = {
    ("prompt_lookup", "sequoia"): "one deterministic continuation per context: no ranked children for a tree",
    ("lookahead", "sequoia"): "the n-gram pool decides the candidates; no ranked star of children",
    ("staged", "sequoia"): "its spine tree is its own construction (depth × top-k)",
    ("layerskip", "sequoia"): "layerskip drafts chains only",
    ("draft_verify", "sequoia"): "draft_verify drafts chains only",
    ("online", "sequoia"): "online's verifier under sampling is Leviathan's chain",
    ("mtp", "sequoia"): "sampled MTP verification needs a chain",
    ("eagle2", "sequoia"): "EAGLE-2 is the dynamic tree; its static trees are eagle's rows",
    ("eagle3", "sequoia"): "EAGLE-3 shares EAGLE's tree-capable drafting; left out for the time budget",
    ("specinfer", "sequoia"): "the merged multi-draft tree is its own construction",
}
# the verifier at temperature 1 (temperature 0: every preset's greedy). q-reading drafters take Leviathan's
# chain on chains, SpecInfer's multi-round rejection on static trees, Sequoia's on Sequoia trees; drafters
# whose drafts are deterministic (q one-hot) take the deterministic verifier, lossless at any temperature.
DETERMINISTIC_AT_T1 = ("autoregressive", "prompt_lookup", "lookahead", "staged", "eagle2", "eagle3")
# Test prompts: every row decodes prompts until τ's relative standard error is at most the experiment's
# workload.tau_se_target (1.2%: 2.5 s.e. inside the 3% goal) or its num_prompts cap (32, under the splits'
# 51-59 documents, each prompt from another document first) is reached (the sequential rule,
# specsim.tau_error). At the former fixed 4 prompts × 48 tokens τ's s.e. was 3-7% (zoo7: 93% of rows within
# 2 s.e., 41% within 3%); SpecInfer (a step accepts 0-8 drafts), prompt lookup and Online SD (τ a property
# of the prompt) and greedy code (the experiment's first 4 code prompts are among the split's hardest: every
# code T = 0 row of vanilla, Sequoia, staged and EAGLE-1 read τ 11-21% below the prediction on them) took
# 12-16 by hand; the rule gives every row the same precision instead of a per-method count.


@dataclass(frozen=True)
class Row:
    method: str
    tree: str  # NATURAL, "chain" or "sequoia<budget>"
    workload: str
    temperature: float
    overrides: tuple[str, ...] = field(default=())

    @property
    def row_id(self) -> str:
        return f"{self.method}__{self.tree}__{self.workload}__T{self.temperature:g}"


def t1_verifier(method: str, tree: str) -> str:
    """The verifier a row at temperature 1 decodes with (see DETERMINISTIC_AT_T1)."""
    if tree.startswith("sequoia"):
        return "sequoia"
    if method in DETERMINISTIC_AT_T1 or (method == "medusa" and tree == NATURAL):
        return "deterministic"  # Medusa's own tree: its heads' top-k (typical acceptance would be lossy)
    if method in ("eagle", "specinfer") and tree == NATURAL:  # static branching trees
        return "specinfer"
    return "chain"


def tree_overrides(tree: str) -> list[str]:
    if tree == NATURAL:
        return []
    if tree == "chain":
        return ["tree=chain"]
    budget = int(tree.removeprefix("sequoia"))
    return ["tree=sequoia", f"tree.budgets=[{budget}]"]


def excluded(method: str, tree: str) -> str | None:
    """Why (method, tree) is not a row, or None when it is one."""
    family = "sequoia" if tree.startswith("sequoia") else tree
    return EXCLUDED.get((method, family))


def rows(methods: Sequence[str] | None = None, workloads: Sequence[str] = WORKLOADS,
         temperatures: Sequence[float] = TEMPERATURES, extra: Sequence[str] = ()) -> list[Row]:
    """The valid rows in priority order: (natural tree, first workload, T=0) for every method, then the
    other workloads, then the other trees, then the other temperatures."""
    methods = list(methods or TREES)
    unknown = sorted(set(methods) - set(TREES))
    if unknown:
        raise ValueError(f"no validation trees for method(s) {unknown}; known: {sorted(TREES)}")
    out = []
    for temperature in temperatures:
        for tier in (0, 1):  # natural trees first, then the others
            for workload in workloads:
                for method in methods:
                    for tree in TREES[method]:
                        if (tree == NATURAL or method == "sequoia") != (tier == 0) or excluded(method, tree):
                            continue
                        out.append(_row(method, tree, workload, temperature, extra))
    return out


def _row(method: str, tree: str, workload: str, temperature: float, extra: Sequence[str]) -> Row:
    ov = [f"method={method}", f"workload={workload}", f"workload.temperature={temperature:g}",
          *tree_overrides(tree)]
    if temperature > 0:
        ov.append(f"method.verifier={t1_verifier(method, tree)}")
    return Row(method, tree, workload, temperature, tuple([*ov, *extra]))


# ---- the driver -----------------------------------------------------------------------------------------
SMALL = ("model=micro", "workload.num_prompts=2", "workload.tau_se_target=0", "workload.max_new_tokens=16",
         "calibration.prompts=4", "calibration.new_tokens=8", "calibration.reps=3", "calibration.warmup=1",
         "calibration.width=8")
SMALL_METHODS = ("autoregressive", "vanilla", "sequoia", "prompt_lookup")  # nothing trained on first use


@dataclass(frozen=True)
class Outcome:
    row: Row
    status: str  # done | skipped | failed | refused (analysis.validation_insample)
    seconds: float
    error: str = ""


def run_rows(selected: Iterable[Row], out: Path, python: str = sys.executable,
             deadline: float | None = None, progress: bool = True,
             check: Callable[[Row, Path], str] | None = None) -> list[Outcome]:
    """Run every row not yet done under ``out`` (resumable); stop starting new rows after ``deadline``
    (time.time()). A failing row leaves failed.json and the sweep goes on; so does a finished row that
    ``check(row, run_dir)`` rejects (a non-empty reason: it set the row's metrics aside)."""
    from tqdm import tqdm

    selected = list(selected)
    outcomes = []
    bar = tqdm(selected, desc="validation", disable=not progress, file=sys.stderr)
    for row in bar:
        run_dir = out / row.row_id
        bar.set_postfix_str(row.row_id)
        if completed(run_dir):
            outcomes.append(Outcome(row, "skipped", 0.0))
            continue
        if deadline is not None and time.time() > deadline:
            break
        if not claim(run_dir):  # another driver on the same sweep runs it now
            continue
        try:
            outcome = run_row(row, run_dir, python)
        finally:
            (run_dir / CLAIM).unlink(missing_ok=True)
        if check is not None and outcome.status == "done" and (why := check(row, run_dir)):
            outcome = Outcome(row, "failed", outcome.seconds, why)
        outcomes.append(outcome)
    return outcomes


def claim(run_dir: Path) -> bool:
    """Take the row for this process (several drivers may share one sweep dir): True if taken. A claim
    whose process is gone (killed) is taken over."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / CLAIM
    for _ in range(2):
        try:
            with open(path, "x") as fh:
                fh.write(str(os.getpid()))
            return True
        except FileExistsError:
            try:
                pid = int(path.read_text() or 0)
                os.kill(pid, 0)
                return False  # alive
            except (ValueError, ProcessLookupError, OSError):
                path.unlink(missing_ok=True)  # its process is gone
    return False


def run_row(row: Row, run_dir: Path, python: str = sys.executable) -> Outcome:
    """One row: ``run.py experiment=validation <overrides> hydra.run.dir=<run_dir>``."""
    repo = Path(__file__).resolve().parents[1]
    cmd = [python, str(repo / "run.py"), "experiment=validation", *row.overrides,
           f"hydra.run.dir={run_dir}"]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True)
    seconds = time.time() - t0
    run_dir.mkdir(parents=True, exist_ok=True)  # run.py removes the dir of a failed single run
    atomic_write_json(run_dir / ROW_FILE, {**asdict(row), "row_id": row.row_id, "command": cmd[1:],
                                           "seconds": seconds, "returncode": proc.returncode})
    if proc.returncode == 0 and completed(run_dir):
        return Outcome(row, "done", seconds)
    error = _last_error(proc.stderr) or f"run.py exited {proc.returncode}"
    atomic_write_json(run_dir / FAILED, {"status": "failed", "error": error, "stderr": proc.stderr[-4000:],
                                         "command": cmd[1:]})
    return Outcome(row, "failed", seconds, error)


def _last_error(stderr: str) -> str:
    """The line that says why a row failed: the last exception or error line of its stderr, passing over
    run.py's closing "Error: the run failed (X); nothing was written." when the traceback above it names X's
    message (that line alone would hide it)."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    hits = [ln for ln in lines if ln.startswith(("Error", "ValueError", "RuntimeError", "KeyError", "Assert"))
            or "Error:" in ln]
    told = [ln for ln in hits if not ln.startswith("Error: the run failed")]
    hits = told or hits
    return (hits[-1] if hits else (lines[-1] if lines else ""))[:500]


def read_row(run_dir: Path) -> dict | None:
    """The row a run dir holds: its validation_row.json, else parsed from the dir name (row_id)."""
    try:
        return json.loads((Path(run_dir) / ROW_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return parse_row_id(Path(run_dir).name)


def parse_row_id(row_id: str) -> dict | None:
    parts = row_id.split("__")
    if len(parts) != 4 or not parts[3].startswith("T"):
        return None
    try:
        temperature = float(parts[3][1:])
    except ValueError:
        return None
    return {"method": parts[0], "tree": parts[1], "workload": parts[2], "temperature": temperature,
            "row_id": row_id}
