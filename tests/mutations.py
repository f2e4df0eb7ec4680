"""Mutation check of the samplers and verifiers (issue 12): does the losslessness suite catch plausible bugs?

Each mutation is one textual edit of methods/core/verify.py or methods/core/sampling.py, a bug that would
make speculative decoding change the target's law (p = target, q = draft). For each, the repository is
copied to a temporary directory, the edit is applied to the copy (never to the checkout), and the
losslessness tests run there; the mutation is *caught* when they fail (pytest exit status 1). The
unmutated copy must pass first. tests/methods/test_mutations.py checks, fast, that every edit still
applies to today's source, so the list cannot silently rot.

    python tests/mutations.py            # every mutation (several minutes on 2 cores)
    python tests/mutations.py -k bonus   # those whose name contains "bonus"
    python tests/mutations.py --slow     # also the real-engine chi-square tests (much longer)
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VERIFY, SAMPLING = "methods/core/verify.py", "methods/core/sampling.py"
# the exact-law proofs, the verifier / sampler unit tests (fast), then the real-engine chi-square (--slow)
TESTS = ("tests/methods/test_verify_exact.py", "tests/methods/test_verify.py",
         "tests/methods/test_sampling.py")
SLOW_TESTS = ("tests/methods/test_statistical.py",)


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    before: str  # must occur exactly once in the file
    after: str
    why: str


MUTATIONS = (
    Mutation("token_drawn_with_the_acceptance_coin", SAMPLING,
             "tok = inverse_cdf(then[i], u[k])", "tok = inverse_cdf(then[i], u[i])",
             "the token ending a run of coins is drawn with the coin that ended it (correlated with it)"),
    Mutation("chain_bonus_from_the_first_position", VERIFY,
             "then = torch.cat([_residual(p[:-1], q), p[-1:]])",
             "then = torch.cat([_residual(p[:-1], q), p[:1]])",
             "after γ accepted drafts the bonus comes from p_0 instead of p_γ (the last accepted node's)"),
    Mutation("greedy_chain_bonus_from_the_root", VERIFY,
             "n_, nxt = torch.stack([n, am[n]]).tolist()", "n_, nxt = torch.stack([n, am[0]]).tolist()",
             "greedy chains: the next token is the root's argmax instead of the last accepted node's"),
    Mutation("residual_without_clamp", VERIFY,
             "r = (p - q).clamp_min(0)", "r = (p - q).abs()",
             "the residual forgets max(0, p − q): |p − q| puts mass where q > p"),
    Mutation("residual_normalised_off_by_one", VERIFY,
             "return torch.where(ok, r / torch.where(ok, m, 1.0), p)",
             "return torch.where(ok, (r + 1e-2) / torch.where(ok, m + 1e-2 * r.shape[-1], 1.0), p)",
             "the residual's normaliser is off (mass added to every token, zeros of max(0, p − q) too)"),
    Mutation("tree_bonus_from_q", VERIFY,
             "then = torch.cat([p[list(kids)], final[None]])",
             "then = torch.cat([(p if draft.q is None else draft.q)[list(kids)], final[None]])",
             "the bonus token after an accepted leaf is drawn from the draft's q instead of the target's p"),
    Mutation("accept_ratio_inverted", VERIFY,
             "return (px / qx.clamp_min(torch.finfo(qx.dtype).tiny)).clamp(max=1.0)",
             "return (qx / px.clamp_min(torch.finfo(px.dtype).tiny)).clamp(max=1.0)",
             "accept with min(1, q/p) instead of min(1, p/q)"),
    Mutation("coin_compared_with_le", SAMPLING,
             "hit = torch.cat([u[:k] < success,", "hit = torch.cat([u[:k] <= success + 0.05,",
             "a coin succeeds with u <= s + slack instead of u < s (an acceptance test off by a margin)"),
    Mutation("sequoia_keeps_q_after_rejection", VERIFY,
             "        q = _renorm(q.index_fill(0, x.view(1), 0.0), q)\n", "",
             "without replacement, the rejected token is not removed from q for the next sibling"),
)


def apply(mutation: Mutation, root: Path) -> None:
    f = root / mutation.path
    text = f.read_text()
    n = text.count(mutation.before)
    if n != 1:
        raise ValueError(f"mutation {mutation.name}: {mutation.before!r} occurs {n} times in {mutation.path}")
    f.write_text(text.replace(mutation.before, mutation.after))


def _copy() -> Path:
    dst = Path(tempfile.mkdtemp(prefix="specsim-mutation-"))
    ignore = shutil.ignore_patterns(".git", ".venv", "outputs", "multirun", "__pycache__", ".pytest_cache",
                                    ".hypothesis", ".ruff_cache", "*.egg-info")
    shutil.copytree(REPO, dst / "repo", ignore=ignore)
    return dst / "repo"


def run_tests(root: Path, tests: tuple[str, ...]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", "not gpu", *tests]
    return subprocess.run(cmd, cwd=root, capture_output=True, text=True)


def check(mutation: Mutation | None, tests: tuple[str, ...]) -> tuple[bool, str]:
    """(tests failed, the failing test's id or the summary line) on a fresh copy with the mutation."""
    root = _copy()
    try:
        if mutation is not None:
            apply(mutation, root)
        proc = run_tests(root, tests)
    finally:
        shutil.rmtree(root.parent, ignore_errors=True)
    lines = proc.stdout.strip().splitlines()
    failed = [ln.split(" - ")[0] for ln in lines if ln.startswith("FAILED")]
    if proc.returncode not in (0, 1):  # collection / internal error: not a test catching the bug
        tail = proc.stdout[-3000:] + proc.stderr[-3000:]
        raise RuntimeError(f"pytest exit status {proc.returncode}:\n{tail}")
    return proc.returncode == 1, (failed[0] if failed else lines[-1] if lines else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-k", default="", help="only mutations whose name contains this")
    ap.add_argument("--slow", action="store_true", help="also run the real-engine chi-square tests")
    args = ap.parse_args(argv)
    tests = TESTS + (SLOW_TESTS if args.slow else ())
    chosen = [m for m in MUTATIONS if args.k in m.name]
    t0 = time.perf_counter()
    failed, summary = check(None, tests)
    state = "FAILS: fix the suite first" if failed else "passes"
    print(f"{'(no mutation)':40s} {state}  {summary}", flush=True)
    if failed:
        return 2
    missed = []
    for m in chosen:
        caught, by = check(m, tests)
        print(f"{m.name:40s} {'caught' if caught else 'MISSED'}  {by}", flush=True)
        if not caught:
            missed.append(m.name)
    print(f"{len(chosen) - len(missed)}/{len(chosen)} mutations caught in {time.perf_counter() - t0:.0f} s")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
