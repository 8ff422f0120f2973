"""Is any expert id repeated within one token's top-k? Vectorised, for the always-on check.

When a (token, layer) row of the compact array fits in 2, 4 or 8 bytes (GLM-4.5: 8 x uint8),
the row is read as one unsigned word and compared with its own lane rotations (SWAR): rotating
by s = 1 .. topk//2 lanes pairs every two lanes once, and an equal pair leaves a zero lane in
``word ^ rotated``. Other shapes compare the array with ``np.roll`` of itself.
"""
import numpy as np

_WORDS = {2: np.uint16, 4: np.uint32, 8: np.uint64}


class DupChecker:
    """Reusable checker for arrays ``[..., topk]`` of one integer dtype (keeps scratch buffers)."""

    def __init__(self, topk: int, dtype):
        self.topk, self.dtype = topk, np.dtype(dtype)
        self.word = _WORDS.get(topk * self.dtype.itemsize)
        if self.word is not None:
            bits, nbits = 8 * self.dtype.itemsize, 8 * np.dtype(self.word).itemsize
            self.low = self.word(sum(1 << (bits * i) for i in range(topk)))   # 0x0101.. per lane
            self.high = self.low << self.word(bits - 1)                        # 0x8080.. per lane
            self.shifts = [(self.word(bits * s), self.word(nbits - bits * s)) for s in range(1, topk // 2 + 1)]
        self._buf = None

    def has_duplicates(self, arr: np.ndarray) -> bool:
        if self.topk < 2 or arr.size == 0:
            return False
        if self.word is None or not arr.flags.c_contiguous:
            return any(bool(np.any(arr == np.roll(arr, s, axis=-1))) for s in range(1, self.topk // 2 + 1))
        w = arr.reshape(-1).view(self.word)
        if self._buf is None or self._buf.shape[1] < w.size:
            self._buf = np.empty((3, w.size), dtype=self.word)
        x, t, acc = (b[: w.size] for b in self._buf)
        acc[...] = 0
        for right, left in self.shifts:
            np.right_shift(w, right, out=x)
            np.left_shift(w, left, out=t)
            np.bitwise_or(x, t, out=x)
            np.bitwise_xor(x, w, out=x)          # a zero lane marks an equal pair
            np.subtract(x, self.low, out=t)
            np.invert(x, out=x)
            np.bitwise_and(t, x, out=t)
            np.bitwise_or(acc, t, out=acc)
        np.bitwise_and(acc, self.high, out=acc)
        return bool(acc.any())
