"""Reading and writing safetensors files with torch alone (no package).

The format (https://github.com/huggingface/safetensors):
  * 8 bytes: N, the header length, an unsigned little-endian 64-bit integer;
  * N bytes: a UTF-8 JSON object, name -> {"dtype": "F32", "shape": [2, 3],
    "data_offsets": [begin, end]} (offsets into the data buffer), and an
    optional "__metadata__": {string: string}; it may be padded with spaces;
  * the data buffer: every tensor row-major, little-endian, back to back.

write_safetensors pads the header to a multiple of 8 bytes and puts the
8-byte dtypes first, then the 4-, 2- and 1-byte ones, so every tensor starts
at a multiple of its element size in the file (mmap-friendly), and writes
atomically (a temporary file in the same directory, fsync, rename).

    from safetensors_io import read, write
    write("model.safetensors", module.state_dict())
    module.load_state_dict(read("model.safetensors"))
"""

import json
import os
import re
import struct
import sys
import tempfile

import torch

# safetensors dtype name <-> torch dtype, element size in bytes.
DTYPES = {
    "F64": (torch.float64, 8),
    "I64": (torch.int64, 8),
    "F32": (torch.float32, 4),
    "I32": (torch.int32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
}
_BY_TORCH = {dt: (name, size) for name, (dt, size) in DTYPES.items()}
# Same-size integer dtypes used to byte-swap on big-endian hosts.
_SWAP_AS = {8: torch.int64, 4: torch.int32, 2: torch.int16}

MAX_HEADER_BYTES = 100 * 1000 * 1000
# The deepest nesting of the header's objects and arrays (the C++ reader's
# kMaxJsonNesting): json.loads recurses, a deeper header is not a real one.
MAX_NESTING = 64
# The largest tensor, in elements, and dimension (the C++ reader's 2^53).
MAX_ELEMENTS = 2**53


def _nesting(text):
    """The deepest nesting of objects and arrays in JSON text (brackets in
    strings do not count)."""
    depth = deepest = 0
    for c in re.findall(r"[\[\]{}]", re.sub(r'"(?:[^"\\]|\\.)*"', '""',
                                             text)):
        if c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth = max(depth - 1, 0)
    return deepest


def _elements(shape):
    """The product of the nonzero dimensions (a zero-element tensor's other
    dimensions still have to be made)."""
    n = 1
    for d in shape:
        n *= max(d, 1)
    return n


class SafetensorsError(ValueError):
    """A file or a tensor that is not valid safetensors."""


def _tensor_bytes(t, size):
    """The tensor's elements, row-major little-endian, as a uint8 buffer."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if sys.byteorder == "big" and size > 1:
        import numpy as np  # noqa: PLC0415 (only on big-endian hosts)
        a = flat.view(_SWAP_AS[size]).numpy().byteswap()
        return memoryview(np.ascontiguousarray(a)).cast("B")
    if flat.numel() == 0:
        return b""
    return memoryview(flat.view(torch.uint8).numpy())


def encode_header(tensors, metadata=None):
    """(header bytes incl. padding, [(name, tensor, element size)] in data
    order). `tensors`: name -> torch.Tensor."""
    entries = []
    for i, (name, t) in enumerate(tensors.items()):
        if not isinstance(name, str) or not name:
            raise SafetensorsError(f"tensor name {name!r} is not a non-empty "
                                   f"string")
        if name == "__metadata__":
            raise SafetensorsError("'__metadata__' cannot name a tensor")
        if not isinstance(t, torch.Tensor):
            raise SafetensorsError(f"'{name}' is a {type(t).__name__}, not a "
                                   f"tensor")
        if t.is_meta:
            raise SafetensorsError(f"'{name}' is on the meta device: it has "
                                   f"no values to write")
        if t.layout != torch.strided:
            raise SafetensorsError(f"'{name}' is a {t.layout} tensor; only "
                                   f"dense tensors can be written")
        if t.dtype not in _BY_TORCH:
            raise SafetensorsError(
                f"'{name}' has dtype {t.dtype}; safetensors_io writes "
                f"{', '.join(str(d) for d in _BY_TORCH)}")
        dname, size = _BY_TORCH[t.dtype]
        entries.append((-size, i, name, t, dname, size))
    entries.sort(key=lambda e: (e[0], e[1]))  # widest first, else in order
    header, order, offset = {}, [], 0
    if metadata:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise SafetensorsError(f"__metadata__ must map strings to "
                                       f"strings, got {k!r}: {v!r}")
        header["__metadata__"] = dict(metadata)
    for _, _, name, t, dname, size in entries:
        n = t.numel() * size
        header[name] = {"dtype": dname, "shape": [int(d) for d in t.shape],
                        "data_offsets": [offset, offset + n]}
        order.append((name, t, size))
        offset += n
    raw = json.dumps(header, separators=(",", ":"),
                     ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return raw, order


def write_safetensors(path, tensors, metadata=None):
    """Writes name -> tensor (and optional str -> str metadata) to `path`,
    atomically. Returns the number of bytes written."""
    raw, order = encode_header(tensors, metadata)
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-" + os.path.basename(path) + ".",
                               dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for _, t, size in order:
                f.write(_tensor_bytes(t, size))
            total = f.tell()
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass
    return total


def _umask():
    m = os.umask(0)
    os.umask(m)
    return m


def read_header(path):
    """(header dict without __metadata__, metadata dict, data buffer offset,
    data buffer length); validates the header against the file's size."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path}: {len(head)} bytes, fewer than the "
                                   f"8 of the header length")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise SafetensorsError(f"{path}: header length {n} is over the "
                                   f"{MAX_HEADER_BYTES} byte limit")
        if n > size - 8:
            raise SafetensorsError(f"{path}: header length {n} runs past the "
                                   f"end of the file ({size} bytes; "
                                   f"truncated?)")
        raw = f.read(n)
    try:
        text = raw.decode("utf-8")
        depth = _nesting(text)
        if depth > MAX_NESTING:
            raise SafetensorsError(f"{path}: the header's objects and arrays "
                                   f"nest {depth} levels deep, over the "
                                   f"{MAX_NESTING} level limit")
        header = json.loads(text)
    except (UnicodeDecodeError, ValueError) as e:
        raise SafetensorsError(f"{path}: the header is not UTF-8 JSON: "
                               f"{e}") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str)
            for k, v in metadata.items()):
        raise SafetensorsError(f"{path}: __metadata__ is not an object of "
                               f"strings")
    data_len = size - 8 - n
    spans = []
    for name, e in header.items():
        bad = f"{path}: tensor '{name}'"
        if not isinstance(e, dict):
            raise SafetensorsError(f"{bad} is not an object")
        dt, shape, offs = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if dt not in DTYPES:
            raise SafetensorsError(f"{bad} has unknown dtype {dt!r} (known: "
                                   f"{', '.join(DTYPES)})")
        if (not isinstance(shape, list) or
                not all(isinstance(d, int) and not isinstance(d, bool) and
                        d >= 0 for d in shape)):
            raise SafetensorsError(f"{bad} has a malformed shape {shape!r}")
        if any(d > MAX_ELEMENTS for d in shape) or _elements(shape) > \
                MAX_ELEMENTS:
            raise SafetensorsError(f"{bad} has a shape {shape} over "
                                   f"{MAX_ELEMENTS} elements")
        if (not isinstance(offs, list) or len(offs) != 2 or
                not all(isinstance(o, int) and not isinstance(o, bool)
                        for o in offs) or not 0 <= offs[0] <= offs[1]):
            raise SafetensorsError(f"{bad} has malformed data_offsets "
                                   f"{offs!r}")
        count = 1
        for d in shape:
            count *= d
        want = count * DTYPES[dt][1]
        if offs[1] - offs[0] != want:
            raise SafetensorsError(f"{bad} has {offs[1] - offs[0]} bytes for "
                                   f"shape {shape} of {dt} ({want} expected)")
        if offs[1] > data_len:
            raise SafetensorsError(f"{bad} ends at byte {offs[1]} of a "
                                   f"{data_len}-byte data buffer (truncated?)")
        spans.append((offs[0], offs[1], name))
    pos = 0
    for begin, end, name in sorted(spans):
        if begin != pos:
            raise SafetensorsError(
                f"{path}: tensor '{name}' starts at byte {begin} of the data "
                f"buffer, not {pos} (tensors must be back to back)")
        pos = end
    if pos != data_len:
        raise SafetensorsError(f"{path}: {data_len - pos} bytes after the "
                               f"last tensor")
    return header, metadata, 8 + n, data_len


def read_safetensors(path):
    """(name -> torch.Tensor in the file's header order, metadata dict)."""
    header, metadata, base, _ = read_header(path)
    out = {}
    with open(path, "rb") as f:
        for name, e in header.items():
            dtype, size = DTYPES[e["dtype"]]
            begin, end = e["data_offsets"]
            if end == begin:
                out[name] = torch.empty(e["shape"], dtype=dtype)
                continue
            buf = bytearray(end - begin)
            f.seek(base + begin)
            if f.readinto(buf) != len(buf):
                raise SafetensorsError(f"{path}: short read of '{name}'")
            t = torch.frombuffer(buf, dtype=dtype)
            if sys.byteorder == "big" and size > 1:
                t = torch.from_numpy(
                    t.view(_SWAP_AS[size]).numpy().byteswap()).view(dtype)
            out[name] = t.reshape(e["shape"])
    return out, metadata


def read(path):
    """name -> torch.Tensor (for module.load_state_dict(read(path)))."""
    return read_safetensors(path)[0]


def write(path, tensors, metadata=None):
    """Same as write_safetensors."""
    return write_safetensors(path, tensors, metadata)
