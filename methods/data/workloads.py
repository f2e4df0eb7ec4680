"""Prompt sets in the spirit of Spec-Bench's task mix, drawn from held-out stdlib modules (no downloads).

Kinds: ``code`` (continue a function: its signature, docstring and first lines), ``prose`` (continue English
from docstrings/comments), ``grounded`` (the prompt carries a function and asks for it again — unchanged,
renamed or without its docstring — so the continuation largely copies the context, as in summarisation,
RAG or code editing: where prompt lookup shines), ``mixed`` (code, prose, grounded in turn) and ``stream``
(Online SD's serving stream: code requests in one fixed order, each a different held-out function, none
repeated — a drafter that learns between requests never sees a prompt twice). Prompts hold
exactly ``prompt_tokens`` tokens (left-truncated) and are deterministic for (workload, tokenizer, seed).
"""

from __future__ import annotations

import ast
import random
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, replace

from methods.data.corpus import Document, corpus
from specsim.config import RunConfig, WorkloadConfig

KINDS = ("code", "prose", "grounded")
STREAM, STREAM_OF = "stream", "code"  # the stream kind serves code requests
_MIN_REST_LINES = 4  # a code continuation worth predicting
_REFERENCE_CHARS = 2000


@dataclass(frozen=True)
class Prompt:
    prompt_id: str  # "<kind>/<module>/<where>", stable across runs
    token_ids: list[int]  # exactly workload.prompt_tokens ids
    text: str  # tokenizer.decode(token_ids)
    kind: str  # code | prose | grounded
    reference: str | None = None  # the source's own continuation (truncated), when there is one
    module: str = ""


@dataclass(frozen=True)
class _Candidate:
    module: str
    where: str
    prefix: str  # text the prompt ends with (left-truncated to prompt_tokens)
    reference: str
    must_keep: str = ""  # grounded: this tail of the prefix must survive the truncation


def calibration_prompts(cfg: RunConfig, tokenizer, new_tokens: int) -> list[Prompt]:
    """The calibration split's prompts a profile is measured on: ``cfg.calibration.prompts`` prompts of the
    run's workload, generations of ``new_tokens`` tokens (every measured input decodes the same ones)."""
    w = replace(cfg.workload, split="calibration", num_prompts=cfg.calibration.prompts,
                max_new_tokens=new_tokens)
    return load_prompts(w, tokenizer, cfg.seed)


def load_prompts(workload: WorkloadConfig, tokenizer, seed: int) -> list[Prompt]:
    """``workload.num_prompts`` prompts of ``workload.kind`` from ``workload.split``.

    Raises ValueError when the split has too few usable candidates (never returns a short list)."""
    assert workload.kind in (*KINDS, "mixed", STREAM), f"unknown workload kind {workload.kind!r}"
    kinds = [STREAM_OF if workload.kind == STREAM else workload.kind] * workload.num_prompts
    if workload.kind == "mixed":
        kinds = [KINDS[i % len(KINDS)] for i in range(workload.num_prompts)]
    code = _parsed(corpus(workload.split, "code")) if {"code", "grounded"} & set(kinds) else []
    per_kind: dict[str, list[Prompt]] = {}
    for kind in KINDS:
        n = kinds.count(kind)
        if n:
            rng = random.Random(f"specsim-workload|{kind}|{workload.split}|{seed}")
            docs = code if kind != "prose" else corpus(workload.split, "prose")
            groups = _CANDIDATES[kind](docs, rng)
            per_kind[kind] = _pick(groups, rng, n, _maker(kind, tokenizer, workload.prompt_tokens))
    out = [per_kind[k].pop(0) for k in kinds]
    if workload.kind == STREAM:  # requests of a stream: no prompt (nor function) twice
        assert len({p.prompt_id for p in out}) == len(out), "a stream repeated a prompt"
    return out


# ---- selection and tokenisation ----------------------------------------------------------------------
def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def tail_ids(tokenizer, text: str, n: int) -> list[int]:
    """The last n token ids of ``text`` (fewer if the text is short). Tokenises only a suffix of the text,
    growing it until it yields > n tokens, so the possibly split first token is dropped."""
    chars = 6 * n + 64
    while True:
        ids = _encode(tokenizer, text[-chars:])
        if len(ids) > n or chars >= len(text):
            return ids[-n:]
        chars *= 2


def _maker(kind: str, tokenizer, n: int) -> Callable[[_Candidate], Prompt | None]:
    def make(c: _Candidate) -> Prompt | None:
        ids = tail_ids(tokenizer, c.prefix, n)
        if len(ids) < n:
            return None
        text = tokenizer.decode(ids)
        if c.must_keep and not text.endswith(c.must_keep):
            return None
        pid = f"{kind}/{c.module}/{c.where}"
        return Prompt(pid, ids, text, kind, c.reference[:_REFERENCE_CHARS], c.module)

    return make


def _pick(groups: dict[str, list[_Candidate]], rng: random.Random, n: int, make) -> list[Prompt]:
    """Round-robin over modules in a seeded order (diversity first), a seeded candidate from each."""
    modules = sorted(groups)
    rng.shuffle(modules)
    pools = {m: rng.sample(groups[m], len(groups[m])) for m in modules}
    out: list[Prompt] = []
    while len(out) < n and any(pools.values()):
        for m in modules:
            if pools[m] and len(out) < n and (p := make(pools[m].pop())) is not None:
                out.append(p)
    if len(out) < n:
        raise ValueError(f"only {len(out)} usable prompts of this kind in the split (asked for {n}); "
                         "lower num_prompts or prompt_tokens")
    return out


# ---- candidates of each kind -------------------------------------------------------------------------
_Function = ast.FunctionDef | ast.AsyncFunctionDef
_ParsedDoc = tuple[Document, list[_Function]]


def _parsed(docs: list[Document]) -> list[_ParsedDoc]:
    """Each code document with its functions (and methods) in source order; parsed once per call."""
    out = []
    for doc in docs:
        try:
            tree = ast.parse(doc.text)
        except SyntaxError:
            continue
        fns = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        out.append((doc, sorted(fns, key=lambda f: f.lineno)))
    return out


def _body_start(fn: _Function) -> int:
    """1-based line of the first statement after the docstring (or the first statement)."""
    has_doc = ast.get_docstring(fn, clean=False) is not None and len(fn.body) > 1
    return fn.body[1 if has_doc else 0].lineno


def code_candidates(docs: list[_ParsedDoc], rng: random.Random) -> dict[str, list[_Candidate]]:
    """Cut each long-enough function 1–3 lines after its docstring; the rest is the reference."""
    groups: dict[str, list[_Candidate]] = {}
    for doc, fns in docs:
        lines = doc.text.splitlines()
        for fn in fns:
            start = _body_start(fn)
            if fn.end_lineno - start + 1 < _MIN_REST_LINES + 3:
                continue
            cut = start - 1 + rng.randint(1, 3)  # number of source lines in the prompt
            prefix = "\n".join(lines[:cut])  # ends at a line's end, not a newline: a clean token boundary
            rest = "\n" + "\n".join(lines[cut : fn.end_lineno])
            cand = _Candidate(doc.module, f"{fn.name}@L{fn.lineno}", prefix, rest)
            groups.setdefault(doc.module, []).append(cand)
    return groups


_SENTENCE_END = re.compile(r"[.!?](?= [A-Z(])")


def prose_candidates(docs: list[Document], rng: random.Random) -> dict[str, list[_Candidate]]:
    """Cut English text after a sentence that has another sentence following in the same paragraph."""
    groups: dict[str, list[_Candidate]] = {}
    for doc in docs:
        for m in _SENTENCE_END.finditer(doc.text):
            cut = m.end()
            if cut < 256 or len(doc.text) - cut < 200:
                continue
            groups.setdefault(doc.module, []).append(
                _Candidate(doc.module, f"c{cut}", doc.text[:cut], doc.text[cut:])
            )
    return groups


def _edit(fn, src: str, rng: random.Random) -> tuple[str, str]:
    """An instruction and the edited copy of a function's (dedented) source."""
    name = fn.name
    options = ["copy", "rename"]
    if ast.get_docstring(fn, clean=False) is not None and len(fn.body) > 2:
        options.append("no_docstring")
    choice = rng.choice(options)
    if choice == "rename":
        new = "new_" + name.strip("_")
        return f"`{name}` again, renamed to `{new}`:", re.sub(rf"\b{re.escape(name)}\b", new, src)
    if choice == "no_docstring":
        doc = fn.body[0]
        lines = src.splitlines()
        lo, hi = doc.lineno - fn.lineno, doc.end_lineno - fn.lineno + 1
        return f"`{name}` again, without its docstring:", "\n".join(lines[:lo] + lines[hi:])
    return f"The same function `{name}`, unchanged:", src


def grounded_candidates(docs: list[_ParsedDoc], rng: random.Random) -> dict[str, list[_Candidate]]:
    """Module text through a function, then an instruction to write it again and the copy's first lines."""
    groups: dict[str, list[_Candidate]] = {}
    for doc, fns in docs:
        lines = doc.text.splitlines()
        for fn in fns:
            if fn.end_lineno - _body_start(fn) + 1 < _MIN_REST_LINES + 1:
                continue
            src = textwrap.dedent("\n".join(lines[fn.lineno - 1 : fn.end_lineno]))
            instruction, copy = _edit(fn, src, rng)
            copy_lines = copy.splitlines()
            head = _body_start(fn) - fn.lineno + rng.randint(0, 1)  # signature (+ one line)
            head = max(1, min(head, len(copy_lines) - _MIN_REST_LINES))
            suffix = f"\n\n\n# {instruction}\n" + "\n".join(copy_lines[:head])
            original = "\n".join(lines[fn.lineno - 1 : fn.end_lineno])
            prefix = "\n".join(lines[: fn.end_lineno]) + suffix
            rest = "\n" + "\n".join(copy_lines[head:])
            where = f"{fn.name}@L{fn.lineno}"
            cand = _Candidate(doc.module, where, prefix, rest, must_keep=original + suffix)
            groups.setdefault(doc.module, []).append(cand)
    return groups


_CANDIDATES = {"code": code_candidates, "prose": prose_candidates, "grounded": grounded_candidates}
