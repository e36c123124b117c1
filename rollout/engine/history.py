"""Draft tokens copied from rollout history: suffix matching over earlier rollouts.

In RL a GRPO group samples one prompt many times and every epoch revisits the same prompts, so a
row's continuation has often been written before: by a sibling generating next to it, by an
earlier epoch's completion of the same prompt, by the prompt itself, or by a recent rollout of
another prompt. `RolloutHistory` keeps those sequences in depth-bounded suffix trees and, for a
row's context, proposes the continuation they most often had (SuffixDecoding, Oliaro et al.; the
`suffix` method of vLLM). A copied token is a point-mass draft verified losslessly elsewhere; this
module only proposes tokens and an estimated probability for each.

Two index backends behave identically (same drafts, probabilities, match lengths):
`ArcticSuffixIndex` wraps the C++ tree of `arctic-inference` (an optional dependency, the one
vLLM uses) and `PythonSuffixIndex` is a pure-Python suffix trie used when it is not installed.
"""
from __future__ import annotations

import struct
from array import array
from bisect import bisect_left, insort
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Protocol, Sequence

_F32 = struct.Struct("f")


def _f32(x: float) -> float:
    """x rounded to float32: the Python trie repeats the C++ tree's float arithmetic exactly."""
    return _F32.unpack(_F32.pack(x))[0]


def _draft_limits(n: int, max_tokens: int, factor: float, offset: float) -> list[int]:
    """[m] how many tokens a match of m < n tokens may draft (the C++ expression, in float32)."""
    f, o = _f32(factor), _f32(offset)
    return [max(min(max_tokens, int(_f32(_f32(m * f) + o) + 1e-6)), 0) for m in range(n)]


@dataclass
class HistoryDraft:
    """Tokens copied from history, each with its estimated probability (cumulative along the
    draft: probs[j] estimates P(tokens[:j+1] | context), so it never increases)."""

    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    match_len: int = 0       # context tokens the draft's source matched
    score: float = 0.0       # sum of probs (float32 sum): how the better of two drafts is picked

    @property
    def cond(self) -> list[float]:
        """P(tokens[j] | context, tokens[:j]) from the counts: ratios of consecutive probs."""
        out, prev = [], 1.0
        for p in self.probs:
            out.append(p / prev)
            prev = p
        return out

    def __len__(self) -> int:
        return len(self.tokens)


class SuffixIndex(Protocol):
    """Sequences of tokens in one suffix tree of bounded depth, each under an int id."""

    backend: str
    depth: int

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None: ...

    def remove(self, seq_id: int) -> None: ...

    def speculate(self, context: Sequence[int], max_tokens: int, min_prob: float,
                  factor: float = 1.0, offset: float = 0.0,
                  seq_id: int | None = None) -> HistoryDraft:
        """The draft continuing `context` (see PythonSuffixIndex.speculate). `seq_id` may name
        a sequence the context ends with: a hint that can only make it faster."""

    def num_seqs(self) -> int: ...

    def num_tokens(self) -> int: ...

    def memory_bytes(self) -> int: ...


_NO_ARCTIC = ("the 'arctic' history backend needs arctic-inference (pip install nanobind==2.9.2 "
              "cmake ninja && pip install --no-build-isolation arctic-inference==0.3.0); "
              "backend='python' needs nothing")


def arctic_available() -> bool:
    try:
        from arctic_inference.suffix_decoding._C import SuffixTree  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(backend: str = "auto") -> str:
    """"arctic" or "python": "auto" is arctic when importable; "arctic" must be importable."""
    if backend == "auto":
        return "arctic" if arctic_available() else "python"
    if backend == "arctic" and not arctic_available():
        raise ImportError(_NO_ARCTIC)
    if backend not in ("arctic", "python"):
        raise ValueError(f"unknown suffix index backend {backend!r} (auto, arctic or python)")
    return backend


def new_index(depth: int, backend: str = "auto") -> SuffixIndex:
    """A suffix index of `depth`: arctic's C++ tree when importable ("auto"), or as named."""
    if resolve_backend(backend) == "arctic":
        return ArcticSuffixIndex(depth)
    return PythonSuffixIndex(depth)


class ArcticSuffixIndex:
    """arctic-inference's SuffixTree (path-compressed, C++), with the index interface."""

    backend = "arctic"

    def __init__(self, depth: int):
        try:
            from arctic_inference.suffix_decoding._C import SuffixTree
        except ImportError as e:
            raise ImportError(_NO_ARCTIC) from e
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.depth = depth
        self._tree = SuffixTree(depth)
        self._lens: dict[int, int] = {}   # seq_id -> tokens held

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        if not tokens:
            return
        self._tree.extend(seq_id, tokens if isinstance(tokens, list) else list(tokens))
        self._lens[seq_id] = self._lens.get(seq_id, 0) + len(tokens)

    def remove(self, seq_id: int) -> None:
        del self._lens[seq_id]              # KeyError for an unknown id, as the Python trie
        self._tree.remove(seq_id)

    def speculate(self, context: Sequence[int], max_tokens: int, min_prob: float,
                  factor: float = 1.0, offset: float = 0.0,
                  seq_id: int | None = None) -> HistoryDraft:
        if len(context) > self.depth + 1:   # longer matches cannot exist: same result, less copying
            context = context[-(self.depth + 1):]
        d = self._tree.speculate(context if isinstance(context, list) else list(context),
                                 max_tokens, factor, offset, min_prob, False)
        return HistoryDraft(d.token_ids, d.probs, d.match_len, d.score)

    def num_seqs(self) -> int:
        return self._tree.num_seqs()

    def num_tokens(self) -> int:
        return sum(self._lens.values())

    def memory_bytes(self) -> int:
        return self._tree.estimate_memory()


_EDGE = 1 << 32     # edge key = node * _EDGE + token (tokens are int32)


class PythonSuffixIndex:
    """Depth-bounded suffix trie with counts, in pure Python (the fallback backend).

    A node's count is the number of suffix start positions (over all sequences, each suffix cut
    at `depth` tokens) whose path passes through or ends at it. Appending a token advances the
    sequence's active nodes (the nodes of its last 0..depth-1 tokens) by one child each:
    O(depth) per token. Removal walks each suffix of the sequence, decrementing counts and
    dropping nodes that reach zero.

    Nodes are integer ids into flat arrays (token, count, stamp, first child) rather than Python
    objects: millions of small objects would cost several times the memory and keep the garbage
    collector busy. A node with one child reaches it through `head` alone; a node that has had
    more keeps its children in `_edges` and their order in `_order`: (-count, stamp, child)
    sorted, head first. That is the C++ tree's sibling order (count descending; within a count, a
    decremented node and an incremented first-of-its-count go first, an incremented other node
    and a new node go last), which decides the draft on ties: `stamp` is -clock for a node that
    entered its count first, +clock for one that entered last. The root's children are all in
    `_edges`; their order is never used (drafts start below the root).
    Memory is about one node per (token, depth) pair not shared with other text, several times
    arctic's path-compressed tree.
    """

    backend = "python"

    def __init__(self, depth: int):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.depth = depth
        self._tok = array("q", [0])         # [node] token on the edge into it
        self._cnt = array("q", [0])         # [node] count
        self._stamp = array("q", [0])       # [node] place among equal-count siblings
        self._head = array("q", [-1])       # [node] first child, -1: none
        self._edges: dict[int, int] = {}    # node * _EDGE + token -> child (root, multi-child)
        self._order: dict[int, list[tuple[int, int, int]]] = {}   # node -> sorted children
        self._free: list[int] = []          # ids of dropped nodes, reused
        self._size = 1                      # ids below are or were in use
        self._clock = 0
        self._nodes = 0
        self._seqs: dict[int, list[int]] = {}
        self._active: dict[int, list[int]] = {}   # seq_id -> nodes of its last 0..depth tokens
        self._limits: dict[tuple, list[int]] = {}  # speculate's settings -> [m] draft limit

    def _grow(self) -> None:
        """More node slots; a free slot holds count 1 and no child, as a new node starts."""
        n = max(1024, len(self._tok) // 4)
        self._tok.extend(array("q", [0]) * n)
        self._cnt.extend(array("q", [1]) * n)
        self._stamp.extend(array("q", [0]) * n)
        self._head.extend(array("q", [-1]) * n)

    # --- building ---------------------------------------------------------------------------

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        if not tokens:
            return
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = self._seqs[seq_id] = []
            self._active[seq_id] = [0]
        active = self._active[seq_id]
        tok, cnt, stamp, head = self._tok, self._cnt, self._stamp, self._head
        edges, order, free = self._edges, self._order, self._free
        depth, clock, size, nodes = self.depth, self._clock, self._size, self._nodes
        for t in tokens:
            t = int(t)
            seq.append(t)
            cnt[0] += 1
            nxt = [0]
            for node in active[:depth]:
                clock += 1
                h, o = -1, None
                if not node:
                    c = edges.get(t, -1)
                else:
                    h = head[node]
                    if h < 0:
                        c = -1
                    else:
                        o = order.get(node)
                        if tok[h] == t:
                            c = h
                        elif o is not None:
                            c = edges.get(node * _EDGE + t, -1)
                        else:
                            c = -1
                if c >= 0:
                    if o is None:                       # the root's or an only child: order moot
                        cnt[c] += 1
                        stamp[c] = -clock
                    else:                               # first among its new count if it was
                        k = cnt[c]                      # first among its old one, else last
                        i = bisect_left(o, (-k, stamp[c]))
                        s = -clock if i == 0 or o[i - 1][0] != -k else clock
                        del o[i]
                        cnt[c] = k + 1
                        stamp[c] = s
                        insort(o, (-k - 1, s, c), 0, i)
                        head[node] = o[0][2]
                    nxt.append(c)
                    continue
                if free:                                # a new node: last among count 1
                    c = free.pop()
                else:
                    c = size
                    size += 1
                    if size > len(tok):
                        self._grow()
                tok[c] = t
                stamp[c] = clock
                nodes += 1
                if not node:
                    edges[t] = c
                elif h < 0:
                    head[node] = c
                else:
                    if o is None:
                        o = order[node] = [(-cnt[h], stamp[h], h)]
                        edges[node * _EDGE + tok[h]] = h
                    o.append((-1, clock, c))
                    edges[node * _EDGE + t] = c
                nxt.append(c)
            active = nxt
        self._clock, self._size, self._nodes = clock, size, nodes
        self._active[seq_id] = active

    def remove(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id)
        del self._active[seq_id]
        tok, cnt, stamp, head = self._tok, self._cnt, self._stamp, self._head
        edges, order = self._edges, self._order
        depth, n = self.depth, len(seq)
        for start in range(n):
            cnt[0] -= 1
            node, o = 0, None
            for idx in range(start, min(n, start + depth)):
                t = seq[idx]
                if node == 0:
                    c = edges[t]
                else:
                    h = head[node]
                    o = order.get(node)
                    c = h if o is None or tok[h] == t else edges[node * _EDGE + t]
                k = cnt[c]
                if k > 1:                               # decremented: first among its new count
                    self._clock += 1
                    cnt[c] = k - 1
                    if o is not None:
                        i = bisect_left(o, (-k, stamp[c]))
                        del o[i]
                        insort(o, (1 - k, -self._clock, c), i)
                        head[node] = o[0][2]
                    stamp[c] = -self._clock
                    node = c
                    continue
                if node == 0:
                    del edges[t]
                elif o is None:
                    head[node] = -1
                else:
                    del edges[node * _EDGE + t]
                    del o[bisect_left(o, (-1, stamp[c]))]
                    if o:
                        head[node] = o[0][2]
                    else:
                        head[node] = -1
                        del order[node]
                self._drop_chain(c)
                break

    def _drop_chain(self, c: int) -> None:
        """Free node c and its subtree, a chain since c's count is 1."""
        while c >= 0:
            nxt = self._head[c]
            o = self._order.pop(c, None)
            if o is not None:
                for _, _, g in o:
                    del self._edges[c * _EDGE + self._tok[g]]
            self._cnt[c], self._head[c] = 1, -1
            self._free.append(c)
            self._nodes -= 1
            c = nxt

    # --- drafting ---------------------------------------------------------------------------

    def speculate(self, context: Sequence[int], max_tokens: int, min_prob: float,
                  factor: float = 1.0, offset: float = 0.0,
                  seq_id: int | None = None) -> HistoryDraft:
        """For each match length m < len(context) (as the C++ tree: never the whole context)
        whose last-m-token string is in the trie, follow the first child while the count-ratio
        probability stays >= min_prob, for at most min(max_tokens, m * factor + offset) tokens;
        keep the draft with the highest score (ties: the longest m).

        `seq_id`, when the context ends with that sequence's tokens, gives the matched nodes of
        its active suffixes without walking. Match lengths are tried from the longest down so a
        draft that cannot beat the best so far is cut short.
        """
        n = len(context)
        if n > self.depth + 1:
            context = context[-(self.depth + 1):]
            n = self.depth + 1
        tok, cnt, head, edges, order = self._tok, self._cnt, self._head, self._edges, self._order
        matched: list[int] = []             # matched[m-1]: node of the context's last m tokens
        if seq_id is not None and n > 1:
            seq = self._seqs.get(seq_id)
            if seq:
                known = min(len(seq), n - 1)
                if seq[-known:] == context[n - known:]:
                    matched = self._active[seq_id][1:known + 1]
        for m in range(len(matched) + 1, n):
            node = edges.get(context[n - m], -1)
            i = n - m + 1
            while node >= 0 and i < n:
                t = context[i]
                h = head[node]
                if h >= 0 and tok[h] == t:
                    node = h
                elif h >= 0 and node in order:
                    node = edges.get(node * _EDGE + t, -1)
                else:
                    node = -1
                i += 1
            if node < 0:
                break
            matched.append(node)
        if not matched:
            return HistoryDraft()
        key = (max_tokens, factor, offset, min_prob)
        limits = self._limits.get(key)
        if limits is None:
            if len(self._limits) > 64:
                self._limits.clear()
            limits = self._limits[key] = (_draft_limits(self.depth + 1, max_tokens, factor, offset)
                                          if _f32(min_prob) <= 1.0 else [0] * (self.depth + 1))
        min_p = _f32(min_prob)
        pack, unpack = _F32.pack, _F32.unpack
        best: HistoryDraft | None = None
        best_score = -1.0
        for m in range(len(matched), 0, -1):
            limit = limits[m]
            if best is not None and limit <= best_score:
                continue
            node = matched[m - 1]
            toks: list[int] = []
            probs: list[float] = []
            prob, score, beaten = 1.0, 0.0, False
            while len(toks) < limit:
                c = head[node]
                if c < 0:
                    break
                cc, cn = cnt[c], cnt[node]
                if cc != cn:
                    prob = unpack(pack(prob * unpack(pack(cc / cn))[0]))[0]
                    if prob < min_p:
                        break
                    if score + prob * (limit - len(toks)) + 1e-4 < best_score:
                        beaten = True
                        break
                toks.append(tok[c])
                probs.append(prob)
                score = score + 1.0 if prob == 1.0 else unpack(pack(score + prob))[0]
                node = c
            if not beaten and (best is None or score > best_score):
                best, best_score = HistoryDraft(toks, probs, m, score), score
        return best

    # --- size -------------------------------------------------------------------------------

    def num_seqs(self) -> int:
        return len(self._seqs)

    def num_tokens(self) -> int:
        return sum(len(s) for s in self._seqs.values())

    def num_nodes(self) -> int:
        return self._nodes

    def memory_bytes(self) -> int:
        """Arrays (4 x 8 bytes per node slot), children maps (an edge entry with its key and
        value ints plus an order tuple, ~200 bytes per multi-child edge), tokens, active lists."""
        return (32 * len(self._tok) + 200 * len(self._edges) + 36 * len(self._free)
                + 8 * self.num_tokens() + 8 * (self.depth + 2) * len(self._seqs))


# --- rollout history -------------------------------------------------------------------------


class _Entry:
    """One distinct prompt: its index holds the prompt (seq 0) and its kept responses."""

    __slots__ = ("index", "responses", "next_seq", "tokens", "active", "memory")

    def __init__(self, index: SuffixIndex, prompt: list[int]):
        self.index = index
        self.responses: OrderedDict[int, _Response] = OrderedDict()   # seq -> resp, oldest first
        self.next_seq = 1
        self.tokens = len(prompt)
        self.active = 0                     # rows of the open call using this entry
        self.memory: int | None = None      # index.memory_bytes() since its last change (None: changed)
        index.extend(0, prompt)


class _Response:
    __slots__ = ("entry", "seq", "gseq", "version", "tokens", "local", "lead")

    def __init__(self, entry: _Entry, seq: int, gseq: int, version: int, lead: list[int]):
        self.entry: _Entry | None = entry   # None once out of its prompt's index
        self.seq = seq                      # id in the prompt's index
        self.gseq: int | None = gseq        # id in the global index; None once out of the window
        self.version = version              # policy version it was sampled under
        self.tokens = 0                     # tokens stored (lead included); 0: not in any index yet
        self.local = True                   # still in its prompt's index
        self.lead = lead                    # prompt's last depth-1 tokens, stored before it


class _Row:
    __slots__ = ("entry", "resp", "tail")

    def __init__(self, entry: _Entry, resp: _Response, tail: list[int]):
        self.entry = entry
        self.resp = resp
        self.tail = tail                    # last tokens of prompt + response (>= depth if any)


class RolloutHistory:
    """What the engine keeps across generate() calls to draft from rollout history.

    Per distinct prompt (key: its token tuple) one suffix index holds the prompt and that
    prompt's responses, each its own sequence: current siblings while they generate and earlier
    calls' (epochs') completions. A global index holds a window of recent responses of all
    prompts. `propose` matches a row's own context (prompt + response so far) in both and keeps
    the better draft, as arctic's SuffixDecodingCache does. Each response is stored after its
    prompt's last depth-1 tokens, so a match can span the prompt/response boundary: a response's
    first tokens are drafted from its siblings' and earlier epochs' openings (the lead counts in
    stats()["tokens"]).

    Settings:
      depth: tree depth = longest context suffix matched (24: vLLM's suffix default).
      max_prompts: prompt entries kept; the least recently used are evicted whole.
      max_responses_per_prompt: responses kept in a prompt's index, oldest dropped first.
      max_held_tokens: tokens kept over all prompt indexes (prompts + responses); beyond it the
        least recently used entries are evicted whole. Bounds memory: at the other defaults, 4096
        prompts x 64 responses of ~1k tokens would be ~260M tokens, tens of GB in any tree.
      window_responses, window_tokens: the global index keeps the newest responses within both
        bounds (FIFO; a response takes its slot when its row begins).
      max_version_lag: responses sampled more than this many policy versions before the current
        call are removed when a call begins (None: never); assumes versions do not decrease.
      min_prob: a draft stops before a token whose estimated probability falls below this.
      spec_factor, spec_offset: a match of m tokens drafts at most m * factor + offset tokens.
      backend: "auto" (arctic when installed, else python), "arctic" or "python".

    Entries used by the open call are never evicted, so the prompt and token bounds can be
    exceeded while a call runs with more distinct prompts than they allow; end_call restores them.
    """

    def __init__(self, depth: int = 24, max_prompts: int = 4096,
                 max_responses_per_prompt: int = 64, max_held_tokens: int | None = 4_000_000,
                 window_responses: int = 256, window_tokens: int = 200_000,
                 max_version_lag: int | None = 8, min_prob: float = 0.1,
                 spec_factor: float = 1.0, spec_offset: float = 0.0, backend: str = "auto"):
        if depth < 1 or max_prompts < 1 or max_responses_per_prompt < 0:
            raise ValueError("depth and max_prompts must be >= 1, max_responses_per_prompt >= 0")
        if window_responses < 0 or window_tokens < 0:
            raise ValueError("window_responses and window_tokens must be >= 0")
        if spec_factor < 0:
            raise ValueError(f"spec_factor must be >= 0, got {spec_factor}")
        self.depth = depth
        self.max_prompts = max_prompts
        self.max_responses_per_prompt = max_responses_per_prompt
        self.max_held_tokens = max_held_tokens
        self.window_responses = window_responses
        self.window_tokens = window_tokens
        self.max_version_lag = max_version_lag
        self.min_prob = min_prob
        self.spec_factor = spec_factor
        self.spec_offset = spec_offset
        self.backend = resolve_backend(backend)
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()   # LRU first
        self._tokens = 0                    # tokens in all prompt indexes
        self._global = new_index(depth, self.backend)
        self._window: OrderedDict[int, _Response] = OrderedDict()   # gseq -> response, oldest first
        self._window_tokens = 0
        self._next_gseq = 0
        self._by_age: deque[_Response] = deque()   # every response still held, oldest first
        self._nlocal = 0                    # responses in prompt indexes
        self._rows: list[_Row] = []

    # --- a call -----------------------------------------------------------------------------

    def begin_call(self, prompts: list[list[int]], policy_version: int) -> list[int]:
        """Register one row per prompt (rows with equal prompts share an entry); returns handles."""
        if self._rows:
            self.end_call()
        if self.max_version_lag is not None:
            self._age_out(policy_version - self.max_version_lag)
        rows = []
        for prompt in prompts:
            prompt = [int(t) for t in prompt]
            key = tuple(prompt)
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = _Entry(new_index(self.depth, self.backend), prompt)
                self._tokens += entry.tokens
            else:
                self._entries.move_to_end(key)
            entry.active += 1
            lead = prompt[max(0, len(prompt) - self.depth + 1):] if self.depth > 1 else []
            resp = _Response(entry, entry.next_seq, self._next_gseq, policy_version, lead)
            entry.next_seq += 1
            self._next_gseq = (self._next_gseq + 1) & 0x7FFFFFFF
            entry.responses[resp.seq] = resp
            self._nlocal += 1
            while len(entry.responses) > self.max_responses_per_prompt:
                self._drop_local(next(iter(entry.responses.values())))
            self._window[resp.gseq] = resp
            while len(self._window) > self.window_responses:
                self._drop_global(next(iter(self._window.values())))
            self._by_age.append(resp)
            rows.append(_Row(entry, resp, prompt[-self.depth:]))
        self._rows = rows
        self._trim_entries()
        return list(range(len(rows)))

    def append(self, row: int, tokens: list[int]) -> None:
        """Add the tokens `row` emitted this round to its response (prompt index and window)."""
        if not tokens:
            return
        r = self._rows[row]
        resp = r.resp
        if resp.tokens:
            stored = tokens
        else:
            stored, resp.lead = resp.lead + list(tokens), None
        n = len(stored)
        if resp.local:
            r.entry.index.extend(resp.seq, stored)
            r.entry.memory = None
            r.entry.tokens += n
            self._tokens += n
        if resp.gseq is not None:
            self._global.extend(resp.gseq, stored)
            self._window_tokens += n
        resp.tokens += n
        tail = r.tail
        tail.extend(tokens)
        if len(tail) > 2 * self.depth:
            del tail[:-self.depth]
        while self._window_tokens > self.window_tokens and self._window:
            self._drop_global(next(iter(self._window.values())))
        if self.max_held_tokens is not None and self._tokens > self.max_held_tokens:
            self._trim_entries()

    def propose(self, row: int, max_tokens: int) -> HistoryDraft:
        """At most `max_tokens` tokens continuing `row`'s context, from the better of its
        prompt's index and the global window (empty when nothing matches)."""
        if max_tokens <= 0:
            return HistoryDraft()
        r = self._rows[row]
        resp = r.resp
        ctx = r.tail[-self.depth:]
        args = (ctx, max_tokens, self.min_prob, self.spec_factor, self.spec_offset)
        best = r.entry.index.speculate(*args, resp.seq if resp.local else None)
        if self._window and best.score < max_tokens:    # ties keep local: max_tokens is unbeatable
            other = self._global.speculate(*args, resp.gseq)
            if other.score > best.score:
                best = other
        return best if best.tokens else HistoryDraft()  # the row's own tail always matches

    def end_call(self) -> None:
        """Close the call: its responses stay as history; empty ones are dropped."""
        for r in self._rows:
            r.entry.active -= 1
            if r.resp.tokens == 0:
                self._drop_local(r.resp)
                self._drop_global(r.resp)
        self._rows = []
        self._trim_entries()
        if len(self._by_age) > 2 * (self._nlocal + len(self._window)) + 64:
            self._by_age = deque(r for r in self._by_age if r.local or r.gseq is not None)

    # --- bounds -----------------------------------------------------------------------------

    def _age_out(self, oldest_version: int) -> None:
        by_age = self._by_age
        while by_age:
            resp = by_age[0]
            if resp.local or resp.gseq is not None:
                if resp.version >= oldest_version:
                    break
                self._drop_local(resp)
                self._drop_global(resp)
            by_age.popleft()

    def _drop_local(self, resp: _Response) -> None:
        if not resp.local:
            return
        resp.local = False
        self._nlocal -= 1
        entry, resp.entry = resp.entry, None
        del entry.responses[resp.seq]
        if resp.tokens:
            entry.index.remove(resp.seq)
            entry.memory = None
            entry.tokens -= resp.tokens
            self._tokens -= resp.tokens

    def _drop_global(self, resp: _Response) -> None:
        if resp.gseq is None:
            return
        del self._window[resp.gseq]
        if resp.tokens:
            self._global.remove(resp.gseq)
            self._window_tokens -= resp.tokens
        resp.gseq = None

    def _trim_entries(self) -> None:
        entries = self._entries
        limit = self.max_held_tokens
        while entries and (len(entries) > self.max_prompts
                           or (limit is not None and self._tokens > limit)):
            key, entry = next(iter(entries.items()))
            if entry.active:                # in-use entries sit at the MRU end: all are in use
                break
            del entries[key]
            self._tokens -= entry.tokens
            self._nlocal -= len(entry.responses)
            for resp in entry.responses.values():   # a response in the window must not keep
                resp.local = False                      # the evicted index alive
                resp.entry = None

    # --- reporting --------------------------------------------------------------------------

    def stats(self) -> dict:
        """Sizes held. memory_bytes walks the trees of the prompts whose index changed since the last
        call (and the window's): ~11 ms for 144k tokens in all, so every call paid it in full before."""
        for e in self._entries.values():
            if e.memory is None:
                e.memory = e.index.memory_bytes()
        return {
            "backend": self.backend,
            "prompts": len(self._entries),
            "responses": self._nlocal,
            "tokens": self._tokens,
            "window_responses": len(self._window),
            "window_tokens": self._window_tokens,
            "memory_bytes": sum(e.memory for e in self._entries.values()) + self._global.memory_bytes(),
        }
