"""Deduplication and decontamination primitives: exact keys, shingle hashes, MinHash signatures and LSH.

Everything here is deterministic across processes, machines and numpy versions: hashes come from blake2b or
from fixed 64-bit arithmetic, never from Python's salted `hash()` or from a numpy random stream (whose bits
numpy does not promise to keep across versions). Work files written by one worker process can therefore be
compared with those of any other.

Shingles. A text is normalised first (lowercased, whitespace runs collapsed to one space), so that case and
layout changes do not hide a duplicate. A shingle is a run of n words or of n UTF-8 bytes of that text; a text
too short for one n-gram counts as one shingle of its whole self. Every shingle is a byte span of one buffer
holding a whole batch of texts, hashed without a loop per shingle: with prefix sums S[i] = sum_{k<i} c_k P^k
(mod 2^64, P odd) the polynomial hash of the span [s, e) is (S[e] - S[s]) * P^-s, the same wherever the span
lies; the splitmix64 finaliser then spreads it over all 64 bits. Polynomial hashes modulo 2^64 can be made to
collide on purpose (Thue-Morse strings); dedup only needs chance collisions to be rare, which they are.

MinHash. Permutation k maps a shingle hash x to ((a_k x + b_k) mod 2^64) >> 32 with a_k odd, a universal
family whose top half is well mixed; the signature entry is the minimum over the document's shingles. A batch
of documents is hashed as one array per permutation and reduced per document with `np.minimum.reduceat`,
which is what makes this fast without compiled code. A document without shingles (an
empty text) gets all 0xFFFFFFFF, so all empty documents look alike.

LSH. The signature is cut into `bands` of `rows` entries; documents whose band slices are equal in any band
are candidates. `lsh_params` picks (bands, rows) minimising the false-positive area below the threshold plus
the false-negative area above it. `near_duplicate_roots` works band by band with O(N) memory: each document's
band slice is hashed to 64 bits, sorted, and runs of equal hashes are buckets, kept in index order. Each
member is compared with the member just before it, then (if not similar) the one before that, up to 8 back,
and last with the bucket's first member; it is joined to the first one found whose full signature agrees on at
least `threshold` of its entries (the Jaccard estimate). This check removes band collisions between
dissimilar documents. Comparing with the bucket's first member alone would lose a whole group when that first
member is an outlier; comparing with every earlier member would cost quadratic time in a bucket of thousands
of boilerplate copies. Looking back a few members costs one check per member of a similar group (the member
just before is almost always similar) and a few per outlier, and joins a group through any run of up to 7
outliers between its members; such runs are rare to begin with, since dissimilar documents seldom share a
whole band, and another band almost always joins the pair anyway. Clusters are connected components of the
similar pairs found, each represented by its smallest index, which is the document kept.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from keel.errors import DataError

KINDS = ("word", "char")
EMPTY_SLOT = np.uint32(0xFFFFFFFF)
_U64 = np.uint64
_MASK = (1 << 64) - 1
_BASE = 0xD6E8FEB86659FD93  # large and odd (so it has an inverse modulo 2^64)
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment
_GROUP_BYTES = 1 << 20  # bytes of text hashed at once: bounds the temporary arrays to tens of MB (larger
# groups were no faster)
_VERIFY_PAIRS = 1 << 15  # candidate pairs whose signatures are compared at once
_LOOK_BACK = 8  # earlier bucket members a document is compared with before the bucket's first


def _inverse(odd: int) -> int:
    """Inverse of an odd number modulo 2^64 (Newton's iteration doubles the correct low bits each step)."""
    x = odd
    for _ in range(6):
        x = (x * (2 - odd * x)) & _MASK
    return x


_BASE_INV = _inverse(_BASE)
_powers: dict[int, np.ndarray] = {}


def _power_table(base: int, length: int) -> np.ndarray:
    """base^0 .. base^(length-1) modulo 2^64, cached; sized for a whole group at once, grown for longer texts."""
    table = _powers.get(base)
    if table is None or len(table) < length:
        size = max(length, 2 * len(table) if table is not None else _GROUP_BYTES + 2)  # a group and its end
        table = np.full(size, base, dtype=_U64)
        table[0] = 1
        table = np.cumprod(table, dtype=_U64)  # wraps modulo 2^64
        _powers[base] = table
    return table[:length]


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, a bijection on 64-bit integers that spreads every input bit over the output."""
    x = x.astype(_U64, copy=True)  # (the products and shifts below then work in place)
    x ^= x >> _U64(30)
    x *= _U64(0xBF58476D1CE4E5B9)
    x ^= x >> _U64(27)
    x *= _U64(0x94D049BB133111EB)
    x ^= x >> _U64(31)
    return x


def _normalise(text: str) -> bytes:
    """Lowercased UTF-8; whitespace is collapsed later, in bulk (`_collapse`), except where it is not ASCII."""
    lowered = text.lower()
    if not lowered.isascii():  # str.split knows Unicode whitespace (no-break space, ideographic space, ...)
        lowered = " ".join(lowered.split())
    return lowered.encode("utf-8", "surrogatepass")


def _is_space(raw: np.ndarray) -> np.ndarray:
    """The bytes str.split() takes for whitespace in ASCII text (space, 0x09-0x0D, 0x1C-0x1F); UTF-8
    multi-byte sequences never contain them. Unsigned wrap-around makes each range one comparison."""
    return (raw == 0x20) | ((raw - np.uint8(0x09)) <= 4) | ((raw - np.uint8(0x1C)) <= 3)


def _collapse(encoded: list[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One buffer of the texts with whitespace runs made one space, each non-empty text followed by a space.

    Returns the buffer, each text's start in it and each text's length (without its trailing space).
    """
    raw = np.frombuffer(b" ".join(encoded) + b" ", dtype=np.uint8)
    space = _is_space(raw)
    # Keep every other byte and the first whitespace byte after one: a text's leading whitespace follows the
    # previous text's separator, so it goes, and its last word keeps one space, which ends it.
    keep = ~space
    keep[1:] |= ~space[:-1]
    regions = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(e) + 1 for e in encoded], out=regions[1:])
    dropped = np.flatnonzero(~keep)  # few in ordinary text: counting them is cheaper than counting the rest
    kept = np.diff(regions) - np.bincount(np.searchsorted(regions, dropped, side="right") - 1,
                                          minlength=len(encoded))
    starts = np.concatenate(([0], np.cumsum(kept)[:-1]))
    buf = np.where(space, np.uint8(0x20), raw)
    if len(dropped):
        buf = buf[keep]
    return buf, starts, np.maximum(kept - 1, 0)


def exact_key(text: str) -> bytes:
    """16-byte key equal for texts that differ only in case and whitespace."""
    folded = " ".join(text.casefold().split()).encode("utf-8", "surrogatepass")
    return hashlib.blake2b(folded, digest_size=16).digest()


def _check_shingle_args(kind: str, n: int) -> None:
    if kind not in KINDS:
        raise DataError(f"shingle kind {kind!r} is not known; valid: {', '.join(KINDS)}")
    if n < 1:
        raise DataError(f"shingle length {n} is too small; it must be at least 1")


@dataclasses.dataclass
class _Group:
    """`_normalise`d texts collapsed into one buffer (see `_collapse`), with the prefix sums of their polynomial
    hash: every kind of shingle of these texts is hashed from the same sums."""

    texts: int
    buf: np.ndarray
    text_start: np.ndarray
    lengths: np.ndarray
    prefix: np.ndarray
    _words: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    @classmethod
    def of(cls, encoded: list[bytes]) -> _Group | None:
        if not any(encoded):
            return None
        buf, text_start, lengths = _collapse(encoded)
        # Prefix sums of (byte + 1) * P^k; the +1 keeps zero bytes from vanishing out of the sum.
        prefix = np.zeros(len(buf) + 1, dtype=_U64)
        terms = buf.astype(_U64)
        terms += _U64(1)
        terms *= _power_table(_BASE, len(buf))
        np.cumsum(terms, out=prefix[1:])
        return cls(len(encoded), buf, text_start, lengths, prefix)

    def words(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every word's start and end in the buffer and each text's first word (found once per group)."""
        if self._words is None:
            is_char = self.buf != 0x20
            prev_space = np.concatenate(([True], ~is_char[:-1]))
            next_space = np.concatenate((~is_char[1:], [True]))
            starts = np.flatnonzero(is_char & prev_space)
            self._words = starts, np.flatnonzero(is_char & next_space) + 1, np.searchsorted(starts, self.text_start)
        return self._words

    def text(self, i: int) -> bytes:
        """Text i as collapsed: lowercased, whitespace runs made one space, no space at either end."""
        start = int(self.text_start[i])
        return self.buf[start:start + int(self.lengths[i])].tobytes()


def _span_hashes(encoded: list[bytes], kind: str, n: int, whole_short: bool) -> tuple[np.ndarray, np.ndarray]:
    """Shingle hashes of `_normalise`d texts, concatenated in text order, and the count per text."""
    return _group_spans(_Group.of(encoded), len(encoded), kind, n, whole_short)


def _group_spans(group: _Group | None, texts: int, kind: str, n: int,
                 whole_short: bool) -> tuple[np.ndarray, np.ndarray]:
    if group is None:
        return np.zeros(0, dtype=_U64), np.zeros(texts, dtype=np.int64)
    buf, text_start, lengths = group.buf, group.text_start, group.lengths
    if kind == "word":
        unit_start, unit_end, first_unit = group.words()
    else:  # every byte of a text is a unit, separators excepted
        nonempty = lengths > 0
        keep = np.ones(len(buf), dtype=bool)
        keep[(text_start + lengths)[nonempty]] = False
        unit_start = np.flatnonzero(keep)
        unit_end = unit_start + 1
        separators_before = np.concatenate(([0], np.cumsum(nonempty)[:-1]))
        first_unit = text_start - separators_before
    units = np.diff(np.append(first_unit, len(unit_start)))
    # Gram g starts at unit g; within its text it may start at position 0 .. units-n (or only at 0, spanning the
    # whole text, when the text is shorter than n and whole_short is set).
    text_of_unit = np.repeat(np.arange(texts), units)
    pos = np.arange(len(unit_start)) - first_unit[text_of_unit]
    last_start = units - n if not whole_short else np.maximum(units - n, 0)
    starts = np.flatnonzero(pos <= last_start[text_of_unit])
    text_last = first_unit + units - 1
    ends = np.minimum(starts + (n - 1), text_last[text_of_unit[starts]])
    span_start, span_end = unit_start[starts], unit_end[ends]
    counts = np.bincount(text_of_unit[starts], minlength=texts).astype(np.int64)
    hashes = group.prefix[span_end] - group.prefix[span_start]
    hashes *= _power_table(_BASE_INV, len(buf) + 1)[span_start]
    return mix64(hashes), counts


def _groups(encoded: list[bytes]) -> list[tuple[int, int]]:
    """[start, end) ranges of texts holding about _GROUP_BYTES each (a longer text is a group of its own)."""
    bounds, start, size = [], 0, 0
    for i, e in enumerate(encoded):
        if size and size + len(e) > _GROUP_BYTES:
            bounds.append((start, i))
            start, size = i, 0
        size += len(e) + 1
    bounds.append((start, len(encoded)))
    return bounds


def shingles_batch(texts: list[str], kind: str, n: int, whole_short: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Shingle hashes of many texts at once: (hashes of all texts one after another, count per text).

    One hash per n-gram position (a repeated n-gram repeats its hash). A text shorter than n units gives one
    shingle of its whole self if `whole_short`, else none; an empty text gives none.
    """
    _check_shingle_args(kind, n)
    encoded = [_normalise(t) for t in texts]
    parts = [_span_hashes(encoded[a:b], kind, n, whole_short) for a, b in _groups(encoded)]
    if not parts:
        return np.zeros(0, dtype=_U64), np.zeros(0, dtype=np.int64)
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def shingles(text: str, kind: str, n: int) -> np.ndarray:
    """uint64 hashes of the word or character (UTF-8 byte) n-grams of the normalised text, in text order."""
    return shingles_batch([text], kind, n)[0]


def ngram_hashes(text: str, n: int) -> np.ndarray:
    """Word n-gram hashes for decontamination; empty when the text has fewer than n words."""
    return shingles_batch([text], "word", n, whole_short=False)[0]


def _permutation_constants(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(a_k odd, b_k) from a splitmix64 stream of the seed; permutation k is the same for any num_perm."""
    counter = (np.arange(1, 2 * num_perm + 1, dtype=_U64) * _U64(_GOLDEN)) + _U64(seed & _MASK)
    values = mix64(counter)
    return values[0::2] | _U64(1), values[1::2]


class MinHasher:
    """MinHash signatures (uint32, num_perm per document) of word or character n-gram shingle sets."""

    def __init__(self, num_perm: int = 128, seed: int = 1, kind: str = "word", n: int = 5) -> None:
        _check_shingle_args(kind, n)
        if num_perm < 1:
            raise DataError(f"num_perm {num_perm} is too small; it must be at least 1")
        if seed < 0:
            raise DataError(f"MinHash seed {seed} is negative; it must be 0 or more")
        self.num_perm, self.seed, self.kind, self.n = num_perm, seed, kind, n
        self._a, self._b = _permutation_constants(num_perm, seed)

    def signatures(self, texts: list[str]) -> np.ndarray:
        """(len(texts), num_perm) uint32 signatures; a text without shingles gets all 0xFFFFFFFF."""
        return scan_hashes(texts, self, 0, keys=False).signatures

    def _group_signatures(self, group: _Group | None, texts: int) -> np.ndarray:
        out = np.full((texts, self.num_perm), EMPTY_SLOT, dtype=np.uint32)
        hashes, counts = _group_spans(group, texts, self.kind, self.n, whole_short=True)
        if len(hashes):
            offsets = np.concatenate(([0], np.cumsum(counts[counts > 0])[:-1]))
            out[np.flatnonzero(counts)] = self._reduce(hashes, offsets)
        return out

    def _reduce(self, hashes: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Per-document minimum of every permutation of the shingle hashes.

        One permutation at a time over the whole batch: long contiguous vectors are what numpy is fastest on
        (a 2-D block of permutations reduced along its first axis was 20 times slower). The shift to the top
        32 bits is monotone, so it is applied after the minimum, to one value per document.
        """
        mins = np.empty((self.num_perm, len(offsets)), dtype=_U64)
        work = np.empty(len(hashes), dtype=_U64)
        for k in range(self.num_perm):
            np.multiply(hashes, self._a[k], out=work)
            work += self._b[k]
            np.minimum.reduceat(work, offsets, out=mins[k])
        mins >>= _U64(32)
        return mins.T.astype(np.uint32)


@dataclasses.dataclass
class ScanHashes:
    """What the scan keeps of a batch of texts, from one normalisation of them: MinHash signatures (no columns
    without a MinHasher), exact keys (`exact_key`; none unless asked) and the word n-gram hashes for
    decontamination with their count per text (none without an n)."""

    signatures: np.ndarray
    keys: list[bytes]
    grams: np.ndarray
    gram_counts: np.ndarray


def scan_hashes(texts: list[str], hasher: MinHasher | None, ngram: int, keys: bool = True) -> ScanHashes:
    """Signatures, exact keys and word `ngram`-gram hashes of `texts` (n-grams only when `ngram` > 0), equal to
    `hasher.signatures`, `exact_key` and `ngram_hashes` of each text. The three share the lowercasing, the
    whitespace collapse and the prefix sums of a group of texts; an ASCII text's exact key is a hash of its
    collapsed bytes (for ASCII, casefold is lower and str.split's whitespace is `_is_space`'s)."""
    encoded = [_normalise(t) for t in texts]
    signatures = (np.full((len(texts), hasher.num_perm), EMPTY_SLOT, dtype=np.uint32) if hasher is not None
                  else np.zeros((len(texts), 0), dtype=np.uint32))
    exact: list[bytes] = []
    grams: list[np.ndarray] = []
    counts: list[np.ndarray] = []
    for a, b in _groups(encoded):
        group = _Group.of(encoded[a:b])
        if hasher is not None:
            signatures[a:b] = hasher._group_signatures(group, b - a)
        for i, text in enumerate(texts[a:b] if keys else ()):
            if group is not None and text.isascii():
                exact.append(hashlib.blake2b(group.text(i), digest_size=16).digest())
            else:
                exact.append(exact_key(text))
        if ngram > 0:
            hashes, per_text = _group_spans(group, b - a, "word", ngram, whole_short=False)
            grams.append(hashes)
            counts.append(per_text)
    return ScanHashes(signatures, exact, np.concatenate(grams) if grams else np.zeros(0, dtype=_U64),
                      np.concatenate(counts) if counts else np.zeros(len(texts), dtype=np.int64))


def candidate_probability(similarity: np.ndarray | float, bands: np.ndarray | int,
                          rows: np.ndarray | int) -> np.ndarray:
    """Chance that two documents of Jaccard similarity J share at least one band: 1 - (1 - J^r)^b."""
    return 1.0 - (1.0 - np.asarray(similarity, dtype=np.float64) ** rows) ** bands


def _area(values: np.ndarray, width: float) -> np.ndarray:
    """Trapezoid-rule integral along the last axis of values sampled evenly over an interval of `width`."""
    step = width / (values.shape[-1] - 1)
    return step * (values.sum(axis=-1) - 0.5 * (values[..., 0] + values[..., -1]))


def lsh_params(threshold: float, num_perm: int) -> tuple[int, int]:
    """(bands, rows), bands * rows <= num_perm, minimising false-positive plus false-negative area.

    The false-positive area is the integral of P(candidate | J) over [0, threshold], the false-negative area
    that of 1 - P(candidate | J) over [threshold, 1]; both weigh the same.
    """
    if not 0 < threshold <= 1:
        raise DataError(f"LSH threshold {threshold} is out of range; it must be in (0, 1]")
    if num_perm < 1:
        raise DataError(f"num_perm {num_perm} is too small; it must be at least 1")
    rows = np.concatenate([np.arange(1, num_perm // b + 1) for b in range(1, num_perm + 1)])
    bands = np.concatenate([np.full(num_perm // b, b) for b in range(1, num_perm + 1)])
    # Trapezoid rule on 1025 points per interval: the areas are smooth, far finer than any (b, r) step.
    below = np.linspace(0.0, threshold, 1025)
    above = np.linspace(threshold, 1.0, 1025)
    p_below = candidate_probability(below[None, :], bands[:, None], rows[:, None])
    p_above = candidate_probability(above[None, :], bands[:, None], rows[:, None])
    error = _area(p_below, threshold) + _area(1.0 - p_above, 1.0 - threshold)
    best = int(np.argmin(error))  # ties go to fewer bands: fewer candidates to check
    return int(bands[best]), int(rows[best])


def lsh_formula(bands: int, rows: int) -> str:
    """One line explaining what (bands, rows) means for the chance of comparing two documents."""
    half = (1.0 - 0.5 ** (1.0 / bands)) ** (1.0 / rows)
    low = (1.0 - 0.9 ** (1.0 / bands)) ** (1.0 / rows)
    high = (1.0 - 0.1 ** (1.0 / bands)) ** (1.0 / rows)
    return (f"P(candidate | J) = 1 - (1 - J^r)^b with b={bands} bands × r={rows} rows; "
            f"10% at J = {low:.2f}, 50% at J = {half:.2f} (≈ (1/b)^(1/r) = {(1 / bands) ** (1 / rows):.2f}), "
            f"90% at J = {high:.2f}")


class UnionFind:
    """Disjoint sets over 0..n-1 with vectorised unions; every set is represented by its smallest member.

    Between calls `parent` is flat (each entry is its set's root), so finding roots is one gather.
    """

    def __init__(self, n: int) -> None:
        self.parent = np.arange(n, dtype=np.int64)

    def find(self, items: np.ndarray) -> np.ndarray:
        return self.parent[items]

    def union(self, left: np.ndarray, right: np.ndarray) -> None:
        left, right = np.asarray(left, dtype=np.int64), np.asarray(right, dtype=np.int64)
        while len(left):
            root_l, root_r = self.parent[left], self.parent[right]
            apart = root_l != root_r
            if not apart.any():
                return
            left, right = left[apart], right[apart]
            low, high = np.minimum(root_l[apart], root_r[apart]), np.maximum(root_l[apart], root_r[apart])
            # Roots only ever point to smaller roots, so there are no cycles and the root stays the minimum.
            np.minimum.at(self.parent, high, low)
            self._flatten()

    def _flatten(self) -> None:
        while True:
            grand = self.parent[self.parent]
            if np.array_equal(grand, self.parent):
                return
            self.parent = grand


def _band_hashes(signatures: np.ndarray, band: int, rows: int, chunk: int = 1 << 16) -> np.ndarray:
    """64-bit hash of every document's slice for one band, reading the signatures a block of rows at a time."""
    n = signatures.shape[0]
    out = np.empty(n, dtype=_U64)
    cols = slice(band * rows, (band + 1) * rows)
    for s in range(0, n, chunk):
        block = np.asarray(signatures[s:s + chunk, cols]).astype(_U64)
        h = np.full(len(block), band, dtype=_U64)
        for c in range(rows):
            h *= _U64(_BASE)
            h += block[:, c]
        out[s:s + chunk] = mix64(h)
    return out


def _similar(signatures: np.ndarray, left: np.ndarray, right: np.ndarray, threshold: float) -> np.ndarray:
    """Mask of pairs whose signatures agree on at least `threshold` of their entries."""
    keep = np.zeros(len(left), dtype=bool)
    need = threshold * signatures.shape[1] - 1e-9  # agreement counts are integers; avoid float round-off
    for s in range(0, len(left), _VERIFY_PAIRS):
        a = np.asarray(signatures[left[s:s + _VERIFY_PAIRS]])
        b = np.asarray(signatures[right[s:s + _VERIFY_PAIRS]])
        keep[s:s + _VERIFY_PAIRS] = (a == b).sum(axis=1) >= need
    return keep


def _link_bucket_members(signatures: np.ndarray, docs: np.ndarray, bucket_start: np.ndarray, threshold: float,
                         sets: UnionFind) -> None:
    """Join each bucket member to the nearest earlier member it is similar to (see the module docstring).

    `docs` are document indices in sorted order, `bucket_start[k]` the sorted position where k's bucket starts.
    Looking back one member, then two, ... up to _LOOK_BACK, and last to the bucket's first member; a member
    stops looking once joined. Checks cost one per similar member and at most _LOOK_BACK + 1 per outlier.
    """
    pending = np.flatnonzero(np.arange(len(docs)) > bucket_start)  # positions with an earlier bucket member
    for back in [*range(1, _LOOK_BACK + 1), None]:
        if back is None:  # last resort: the bucket's first member, unless it was within reach already
            pending = pending[pending - bucket_start[pending] > _LOOK_BACK]
            earlier = bucket_start[pending]
        else:
            pending = pending[pending - back >= bucket_start[pending]]
            earlier = pending - back
        if not len(pending):
            return
        left, right = docs[earlier], docs[pending]
        joined = sets.find(left) == sets.find(right)  # already in one cluster: nothing to check
        ok = np.zeros(len(pending), dtype=bool)
        ok[~joined] = _similar(signatures, left[~joined], right[~joined], threshold)
        sets.union(left[ok], right[ok])
        pending = pending[~(joined | ok)]


def near_duplicate_roots(signatures: np.ndarray, bands: int, rows: int, threshold: float,
                         alive: np.ndarray | None = None) -> np.ndarray:
    """Cluster root of every document (its cluster's smallest index); documents with root[i] == i are kept.

    `signatures` may be a np.memmap of shape (N, num_perm); documents outside `alive` take part in nothing.
    """
    if signatures.ndim != 2:
        raise DataError(f"signatures have shape {signatures.shape}; expected (documents, num_perm)")
    n, width = signatures.shape
    if bands < 1 or rows < 1 or bands * rows > width:
        raise DataError(f"LSH bands={bands} × rows={rows} do not fit {width} signature entries; "
                        "both must be at least 1 with bands × rows <= num_perm")
    if not 0 < threshold <= 1:
        raise DataError(f"near-duplicate threshold {threshold} is out of range; it must be in (0, 1]")
    if alive is not None and (alive.shape != (n,) or alive.dtype != bool):
        raise DataError(f"alive mask has shape {alive.shape} and dtype {alive.dtype}; expected ({n},) bool")
    live = np.arange(n) if alive is None else np.flatnonzero(alive)
    sets = UnionFind(n)
    for band in range(bands):
        keys = _band_hashes(signatures, band, rows)[live]
        order = np.argsort(keys, kind="stable")  # stable: a bucket's members stay in index order
        sorted_keys = keys[order]
        docs = live[order]
        same = sorted_keys[1:] == sorted_keys[:-1]
        if not same.any():
            continue
        new_bucket = np.concatenate(([True], ~same))
        bucket_start = np.flatnonzero(new_bucket)[np.cumsum(new_bucket) - 1]  # sorted position of the first
        _link_bucket_members(signatures, docs, bucket_start, threshold, sets)
    return sets.parent.copy()
