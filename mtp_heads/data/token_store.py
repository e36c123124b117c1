"""A sharded, memory-mapped store of token sequences with the policy's hidden states.

What the draft heads train on, per token t of a sequence: the token id, the policy's
final-norm hidden state h_t (bf16; it predicts tokens[t+1]: logits = lm_head(h_t)) and
whether tokens[t+1] is assistant/completion text (the loss mask).

Reading (what `distill` codes against)::

    store = TokenStore(root)                  # checks every listed shard (sizes + sha256)
    store.meta                                # {"policy_fingerprint", "weights_digest", "hidden_size",
                                              #  "vocab_size", "dtype": "bfloat16", "model", "max_len", ...}
    train = store.split("train")              # or "heldout"; sources=("sharegpt", "onpolicy") filters
    len(train); store.num_tokens("train"); store.num_loss_tokens("train")
    seq = train[i]                            # random access, any order (memory-mapped)
    seq.tokens     # [T] int64
    seq.hidden     # [T, d] bfloat16, hidden[t] predicts tokens[t+1]
    seq.loss_mask  # [T] bool, True where tokens[t+1] is assistant/completion text (last is False)
    seq.source     # "sharegpt" | "onpolicy" | "rollout";  seq.key: conversation / prompt id
    train.lengths()                           # [n] int64, for batching by length
    add_rollouts(StoreWriter.existing(root), [(tokens, hidden, prompt_len, key), ...])   # builder.py
    for seq in train: ...

A corrupt or partial shard raises CorruptShardError naming it (TokenStore(root,
on_corrupt="skip") warns and leaves it out instead); the builder deletes and rebuilds it.

On disk::

    root/manifest.json               meta + {shard name: split, source, counts, sizes, sha256 per file}
    root/shards/<source>-<split>-<index:05d>/
        tokens.npy     [N] int32          hidden.npy  [N, d] uint16 (bf16 bits)
        loss_mask.npy  [N] bool           offsets.npy [n+1] int64 (sequence i = rows offsets[i]:offsets[i+1])
        source.npy     [n] uint8 (index into SOURCES)
        keys.json      [n] conversation / prompt ids (held-out membership is decided on them)

A shard is written into root/.tmp, fsynced, renamed into root/shards, and only then entered
into the manifest (itself replaced atomically), so a reader never sees a half-written shard
and an interrupted build loses at most the shard it was writing.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rollout.fileio import atomic_write, file_sha256

FORMAT_VERSION = 1
SOURCES = ("sharegpt", "onpolicy", "rollout")
SPLITS = ("train", "heldout")
ARRAYS = ("tokens", "hidden", "loss_mask", "offsets", "source")
MANIFEST = "manifest.json"


class CorruptShardError(RuntimeError):
    """A shard listed in the manifest is missing, truncated or fails its checksum."""

    def __init__(self, root: Path, problems: dict[str, str]):
        self.shards = sorted(problems)
        lines = "; ".join(f"shard {n}: {p}" for n, p in sorted(problems.items()))
        super().__init__(f"token store {root}: {lines}. Re-run the builder (experiments/build_head_data.py) "
                         "on this store: it deletes and rebuilds exactly these shards.")


def shard_name(source: str, split: str, index: int) -> str:
    return f"{source}-{split}-{index:05d}"


@dataclass
class ShardArrays:
    """One shard's content in memory, as the builder produces it."""

    tokens: np.ndarray      # [N] int32
    hidden: np.ndarray      # [N, d] uint16 (bf16 bits)
    loss_mask: np.ndarray   # [N] bool
    offsets: np.ndarray     # [n+1] int64
    source: np.ndarray      # [n] uint8
    keys: list[str]         # [n]

    @classmethod
    def from_sequences(cls, seqs: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray, str, str]]) -> "ShardArrays":
        """seqs: (tokens [T] int, hidden [T, d] uint16, loss_mask [T] bool, source, key) each."""
        if not seqs:
            raise ValueError("a shard needs at least one sequence")
        lengths = [len(s[0]) for s in seqs]
        for tok, hid, mask, src, _ in seqs:
            if hid.dtype != np.uint16 or hid.ndim != 2 or len(hid) != len(tok) or len(mask) != len(tok):
                raise ValueError(f"sequence arrays disagree: tokens {tok.shape}, hidden {hid.shape} {hid.dtype}, "
                                 f"loss_mask {mask.shape} (hidden must be uint16-viewed bf16 [T, d])")
            if src not in SOURCES:
                raise ValueError(f"unknown source {src!r}; expected one of {SOURCES}")
        return cls(tokens=np.concatenate([s[0] for s in seqs]).astype(np.int32),
                   hidden=np.ascontiguousarray(np.concatenate([s[1] for s in seqs])),
                   loss_mask=np.concatenate([s[2] for s in seqs]).astype(bool),
                   offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                   source=np.asarray([SOURCES.index(s[3]) for s in seqs], dtype=np.uint8),
                   keys=[s[4] for s in seqs])



def _fsync_write(path: Path, write) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(root: Path) -> dict:
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"no token store at {root} ({MANIFEST} missing); build one with "
                                "experiments/build_head_data.py")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: format {manifest.get('format')} is not {FORMAT_VERSION}; rebuild the store")
    return manifest


def check_shard(root: Path, name: str, entry: dict, full: bool = True) -> str | None:
    """None if the shard on disk matches its manifest entry, else what is wrong with it."""
    d = Path(root) / "shards" / name
    for fname, want in entry["files"].items():
        p = d / fname
        if not p.is_file():
            return f"{fname} is missing"
        size = p.stat().st_size
        if size != want["bytes"]:
            return f"{fname} has {size} bytes, expected {want['bytes']} (partial or truncated)"
        if full and file_sha256(p) != want["sha256"]:
            return f"{fname} fails its sha256 checksum"
    return None


class StoreWriter:
    """Adds shards to a store (creating it), one manifest update per shard, under a file lock."""

    def __init__(self, root: str | os.PathLike, meta: dict):
        self.root = Path(root).expanduser()
        (self.root / "shards").mkdir(parents=True, exist_ok=True)
        with self._locked():
            path = self.root / MANIFEST
            if path.is_file():
                manifest = read_manifest(self.root)
                if manifest["meta"] != meta:
                    diff = {k: (manifest["meta"].get(k), meta.get(k)) for k in set(manifest["meta"]) | set(meta)
                            if manifest["meta"].get(k) != meta.get(k)}
                    raise ValueError(f"token store {self.root} was built with other settings {diff} "
                                     "(stored, requested); use another root or delete it")
            else:
                atomic_write(path, json.dumps({"format": FORMAT_VERSION, "meta": meta, "shards": {}},
                                                   indent=1, sort_keys=True))
        self.meta = meta

    @classmethod
    def existing(cls, root: str | os.PathLike) -> "StoreWriter":
        """A writer for a store that exists, with its own meta (e.g. the co-trainer adding rollouts;
        check store.meta["policy_fingerprint"] against the policy first)."""
        return cls(root, read_manifest(Path(root).expanduser())["meta"])

    @contextmanager
    def _locked(self):
        with open(self.root / ".manifest.lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def manifest(self) -> dict:
        return read_manifest(self.root)

    def check(self, name: str, full: bool = True) -> str | None:
        """None when `name` is in the manifest and intact; else why not ("not built" if absent)."""
        entry = self.manifest()["shards"].get(name)
        return "not built" if entry is None else check_shard(self.root, name, entry, full)

    def drop(self, name: str) -> None:
        """Remove a shard from the manifest and from disk (before rebuilding it)."""
        with self._locked():
            manifest = self.manifest()
            if manifest["shards"].pop(name, None) is not None:
                atomic_write(self.root / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
        shutil.rmtree(self.root / "shards" / name, ignore_errors=True)

    def add_shard(self, name: str, split: str, data: ShardArrays, params: dict | None = None) -> dict:
        """Write `data` as shard `name` of `split` and list it in the manifest; returns its entry.

        params: the settings that made this shard (kept in its entry; the builder refuses to
        extend a (source, split) whose existing shards were made with other settings)."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if len(set(data.source.tolist())) != 1:
            raise ValueError(f"shard {name}: all sequences of a shard must come from one source")
        d = self.meta.get("hidden_size")
        if d is not None and data.hidden.shape[1] != d:
            raise ValueError(f"hidden states have width {data.hidden.shape[1]}, the store holds {d}")
        tmp_root = self.root / ".tmp"
        tmp_root.mkdir(exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{name}.", dir=tmp_root))
        try:
            files = {}
            for field in ARRAYS:
                _fsync_write(tmp / f"{field}.npy", lambda f, a=getattr(data, field): np.save(f, a))
            _fsync_write(tmp / "keys.json", lambda f: f.write(json.dumps(data.keys).encode()))
            for p in sorted(tmp.iterdir()):
                files[p.name] = {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
            for p in tmp.iterdir():
                os.chmod(p, 0o644)
            os.chmod(tmp, 0o755)
            target = self.root / "shards" / name
            shutil.rmtree(target, ignore_errors=True)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        entry = {"split": split, "source": SOURCES[int(data.source[0])], "files": files,
                 "num_sequences": len(data.keys), "num_tokens": int(len(data.tokens)),
                 "num_loss_tokens": int(data.loss_mask.sum()), "params": params or {}}
        with self._locked():
            manifest = self.manifest()
            manifest["shards"][name] = entry
            atomic_write(self.root / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
        return entry


@dataclass
class TokenSequence:
    """One sequence of the store, as torch tensors (copies: safe to keep and modify)."""

    tokens: torch.Tensor      # [T] int64
    hidden: torch.Tensor      # [T, d] bfloat16; hidden[t] predicts tokens[t+1]
    loss_mask: torch.Tensor   # [T] bool; True where tokens[t+1] is assistant/completion text
    source: str
    key: str


class _Shard:
    """The memory-mapped arrays of one shard."""

    def __init__(self, path: Path):
        self.arrays = {f: np.load(path / f"{f}.npy", mmap_mode="r") for f in ARRAYS}
        self.keys: list[str] = json.loads((path / "keys.json").read_text())


class SplitView:
    """Sequences of some shards (one split, some sources), indexable in any order."""

    def __init__(self, shards: list[_Shard]):
        self._shards = shards
        self._index = [(si, j) for si, sh in enumerate(shards) for j in range(len(sh.keys))]  # (shard, seq)
        self._lengths = np.concatenate([np.diff(np.asarray(sh.arrays["offsets"])) for sh in shards]
                                       or [np.zeros(0)]).astype(np.int64)

    def __len__(self) -> int:
        return len(self._index)

    def lengths(self) -> np.ndarray:
        """[n] int64 tokens per sequence."""
        return self._lengths

    def key(self, i: int) -> str:
        s, j = self._index[i]
        return self._shards[s].keys[j]

    def __getitem__(self, i: int) -> TokenSequence:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sequence {i} out of range for {len(self)} sequences")
        s, j = self._index[i]
        a = self._shards[s].arrays
        lo, hi = int(a["offsets"][j]), int(a["offsets"][j + 1])
        return TokenSequence(
            tokens=torch.from_numpy(np.array(a["tokens"][lo:hi], dtype=np.int64)),
            hidden=torch.from_numpy(np.array(a["hidden"][lo:hi])).view(torch.bfloat16),
            loss_mask=torch.from_numpy(np.array(a["loss_mask"][lo:hi], dtype=bool)),
            source=SOURCES[int(a["source"][j])], key=self._shards[s].keys[j])

    def __iter__(self) -> Iterator[TokenSequence]:
        for i in range(len(self)):
            yield self[i]


class TokenStore:
    """Read side of the store (see the module docstring for the API)."""

    def __init__(self, root: str | os.PathLike, *, verify: str = "full", on_corrupt: str = "raise"):
        # verify: "full" (sizes + sha256, ~1 s per GB), "size" or "none"; on_corrupt: "raise" | "skip"
        if verify not in ("full", "size", "none") or on_corrupt not in ("raise", "skip"):
            raise ValueError(f"verify must be full|size|none and on_corrupt raise|skip, got {verify!r}, {on_corrupt!r}")
        self.root = Path(root).expanduser()
        manifest = read_manifest(self.root)
        self.meta: dict = manifest["meta"]
        entries = manifest["shards"]
        problems = {} if verify == "none" else {
            n: p for n, e in entries.items() if (p := check_shard(self.root, n, e, full=verify == "full"))}
        if problems and on_corrupt == "raise":
            raise CorruptShardError(self.root, problems)
        for n, p in problems.items():
            warnings.warn(f"token store {self.root}: leaving out shard {n} ({p})")
        self.entries = {n: e for n, e in sorted(entries.items()) if n not in problems}
        self._open: dict[str, _Shard] = {}

    def shards(self, split: str) -> list[str]:
        return [n for n, e in self.entries.items() if e["split"] == split]

    def _shard(self, name: str) -> _Shard:
        if name not in self._open:
            self._open[name] = _Shard(self.root / "shards" / name)
        return self._open[name]

    def split(self, split: str, sources: Sequence[str] | None = None) -> SplitView:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        bad = [s for s in sources or () if s not in SOURCES]
        if bad:
            raise ValueError(f"unknown sources {bad}; expected some of {SOURCES}")
        return SplitView([self._shard(n) for n in self.shards(split)
                          if sources is None or self.entries[n]["source"] in sources])

    def num_tokens(self, split: str, sources: Sequence[str] | None = None) -> int:
        return int(sum(e["num_tokens"] for n, e in self.entries.items()
                       if e["split"] == split and (sources is None or e["source"] in sources)))

    def num_loss_tokens(self, split: str, sources: Sequence[str] | None = None) -> int:
        return int(sum(e["num_loss_tokens"] for n, e in self.entries.items()
                       if e["split"] == split and (sources is None or e["source"] in sources)))

    def summary(self) -> dict:
        """{split: {source: {"sequences", "tokens", "loss_tokens", "shards"}}} and the bytes on disk."""
        out: dict = {}
        for e in self.entries.values():
            s = out.setdefault(e["split"], {}).setdefault(e["source"], {"sequences": 0, "tokens": 0,
                                                                         "loss_tokens": 0, "shards": 0})
            s["sequences"] += e["num_sequences"]
            s["tokens"] += e["num_tokens"]
            s["loss_tokens"] += e["num_loss_tokens"]
            s["shards"] += 1
        out["bytes"] = sum(f["bytes"] for e in self.entries.values() for f in e["files"].values())
        return out
