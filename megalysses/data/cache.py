"""A lock-free cache of numpy index arrays, safe when many ranks on many nodes start at once.

    arrays = cached_arrays("data/cache", "corpus_text_document-train", key, build, ["doc", "sample", "shuffle"])

Files are named by a hash of `key` (everything the arrays depend on). A process whose files are
missing builds the arrays itself and writes each one to a unique temporary name followed by
`os.replace`, which is atomic: readers see a whole file or none, concurrent writers write the same
bytes, and nobody waits on anyone else's file. A read-only or full disk only costs the cache.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import uuid
from typing import Any, Callable, Optional

import numpy as np

log = logging.getLogger(__name__)


def hash_key(key: dict[str, Any]) -> str:
    """A stable 16-hex-digit digest of a JSON-able dict (numpy arrays are hashed by their bytes)."""
    h = hashlib.sha256()
    for name in sorted(key):
        value = key[name]
        h.update(name.encode())
        if isinstance(value, np.ndarray):
            h.update(str(value.dtype).encode())
            h.update(np.ascontiguousarray(value).data)
        else:
            h.update(json.dumps(value, sort_keys=True).encode())
    return h.hexdigest()[:16]


def _atomic_write(path: str, write: Callable[[Any], None]) -> None:
    tmp = f"{path}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def cached_arrays(cache_dir: Optional[str], stem: str, key: dict[str, Any],
                  build: Callable[[], dict[str, np.ndarray]], names: list[str]) -> dict[str, np.ndarray]:
    """Load `names` from `{cache_dir}/{stem}-{hash}-{name}.npy` (mmap), or build and save them.

    With cache_dir None nothing is read or written.
    """
    if cache_dir is None:
        return build()
    digest = hash_key(key)
    paths = {n: os.path.join(cache_dir, f"{stem}-{digest}-{n}.npy") for n in names}
    if all(os.path.isfile(p) for p in paths.values()):
        try:
            return {n: np.load(p, mmap_mode="r", allow_pickle=False) for n, p in paths.items()}
        except (OSError, ValueError) as err:
            log.warning("cached index %s unreadable (%s); rebuilding", cache_dir, err)
    arrays = build()
    try:
        os.makedirs(cache_dir, exist_ok=True)
        description = {k: v for k, v in key.items() if not isinstance(v, np.ndarray)}
        _atomic_write(os.path.join(cache_dir, f"{stem}-{digest}-description.json"),
                      lambda f: f.write(json.dumps(description, indent=2, sort_keys=True).encode()))
        for n, p in paths.items():
            _atomic_write(p, lambda f, a=arrays[n]: np.save(f, a, allow_pickle=False))
    except OSError as err:
        log.warning("could not write the index cache in %s (%s); using the in-memory index", cache_dir, err)
    return arrays
