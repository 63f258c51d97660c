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
atomically (OutputFile: a temporary file in the same directory, fsync,
rename; a destination that is a device or a FIFO is written in place).

read_header / read_safetensors refuse (SafetensorsError, naming the file
and the tensor) anything that is not a regular file holding a valid
header: sizes, offsets and shapes are checked against each other and the
file's size before anything is read or allocated.

    from safetensors_io import read, write
    write("model.safetensors", module.state_dict())
    module.load_state_dict(read("model.safetensors"))
"""

import errno
import json
import os
import re
import stat
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


class OutputFile:
    """A file written whole or not at all. The bytes go to a temporary file
    beside the destination (same directory: the rename is atomic), which
    commit() flushes, fsyncs and renames over it; discard() (call it on any
    error) removes the temporary file and leaves the destination as it was.
    A symbolic link is followed (the file it names is replaced, not the
    link). A destination that exists and is not a regular file (a device
    such as /dev/stdout or /dev/full, a FIFO) is written in place: renaming
    over it would replace the device node itself; its write errors (a full
    device) surface at commit() as OSError too.

    finish() (commit's first half) lets a caller write several files and
    rename them only once every one of them is complete."""

    def __init__(self, path):
        self.path = path
        self.dest = os.path.realpath(path)
        self.tmp = None
        try:
            mode = os.stat(self.dest).st_mode
        except FileNotFoundError:
            mode = None
        if mode is not None and stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
        if mode is not None and not stat.S_ISREG(mode):
            self.f = open(self.dest, "wb")  # noqa: SIM115 (closed by finish)
            return
        # A file replaced keeps its permissions (a private 0600 one stays
        # private); a new one gets 0644 less the umask.
        self.mode = stat.S_IMODE(mode) if mode is not None else \
            0o644 & ~_umask()
        d = os.path.dirname(self.dest)
        fd, self.tmp = tempfile.mkstemp(
            prefix=".tmp-" + os.path.basename(self.dest) + ".", dir=d)
        self.f = os.fdopen(fd, "wb")

    def write(self, data):
        self.f.write(data)

    def finish(self):
        """Flushes and closes the file (fsyncs a temporary file): every
        byte is written, or OSError."""
        if self.f.closed:
            return
        try:
            self.f.flush()
            if self.tmp is not None:
                os.fsync(self.f.fileno())
        finally:
            self.f.close()

    def commit(self):
        """finish(), then the temporary file takes the destination's name
        (and the permissions of the file it replaces, else 0644 less the
        umask)."""
        self.finish()
        if self.tmp is None:
            return
        os.chmod(self.tmp, self.mode)
        os.replace(self.tmp, self.dest)
        self.tmp = None
        try:
            dfd = os.open(os.path.dirname(self.dest), os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError:
            pass

    def discard(self):
        """Closes and removes the temporary file (quietly; after an error)."""
        try:
            self.f.close()
        except OSError:
            pass
        if self.tmp is not None:
            try:
                os.unlink(self.tmp)
            except OSError:
                pass
            self.tmp = None


def write_to(out, tensors, metadata=None):
    """Writes name -> tensor (and optional metadata) as safetensors into
    the open binary file (or OutputFile) `out`; returns the bytes written."""
    return _write_encoded(out, *encode_header(tensors, metadata))


def _write_encoded(out, raw, order):
    """write_to with the header already encoded (encode_header's)."""
    out.write(struct.pack("<Q", len(raw)))
    out.write(raw)
    total = 8 + len(raw)
    for _, t, size in order:
        data = _tensor_bytes(t, size)
        out.write(data)
        total += len(data) if isinstance(data, bytes) else data.nbytes
    return total


def write_safetensors(path, tensors, metadata=None):
    """Writes name -> tensor (and optional str -> str metadata) to `path`,
    atomically (OutputFile). Returns the number of bytes written."""
    encoded = encode_header(tensors, metadata)  # a bad tensor fails before any file
    out = OutputFile(path)
    try:
        total = _write_encoded(out, *encoded)
        out.commit()
    except BaseException:
        out.discard()
        raise
    return total


def _umask():
    m = os.umask(0)
    os.umask(m)
    return m


def _open_regular(path):
    """`path` opened for reading, and its size; SafetensorsError when it is
    not a regular file (a FIFO would block the read, a directory or a
    device has no safetensors size)."""
    try:
        # O_NONBLOCK: opening a FIFO does not wait for a writer (it is
        # refused below); no effect on a regular file's reads.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except IsADirectoryError:
        raise SafetensorsError(f"{path}: not a regular file (a directory)") \
            from None
    except OSError as e:
        raise SafetensorsError(f"{path}: cannot open: {e.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else \
            "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device or socket"
        raise SafetensorsError(f"{path}: not a regular file ({kind})")
    return os.fdopen(fd, "rb"), st.st_size


def _no_duplicates(pairs):
    """json object_pairs_hook: a name given twice is refused (which entry
    is meant?) instead of the last one silently winning."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise SafetensorsError(f"'{k}' appears twice in an object of "
                                   f"the header")
        out[k] = v
    return out


def read_header(path):
    """(header dict without __metadata__, metadata dict, data buffer offset,
    data buffer length); validates the header against the file's size."""
    f, size = _open_regular(path)
    with f:
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
        if len(raw) != n:
            raise SafetensorsError(f"{path}: short read of the header")
    try:
        text = raw.decode("utf-8")
        depth = _nesting(text)
        if depth > MAX_NESTING:
            raise SafetensorsError(f"the header's objects and arrays "
                                   f"nest {depth} levels deep, over the "
                                   f"{MAX_NESTING} level limit")
        header = json.loads(text, object_pairs_hook=_no_duplicates)
    except SafetensorsError as e:
        raise SafetensorsError(f"{path}: {e}") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise SafetensorsError(f"{path}: the header is not UTF-8 JSON: "
                               f"{e}") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: the header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if metadata is None:  # null: no metadata, unambiguously
        metadata = {}
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
        if not isinstance(dt, str) or dt not in DTYPES:
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
    f, _ = _open_regular(path)
    with f:
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
            if dtype == torch.bool and buf.translate(None, b"\x00\x01"):
                # torch.bool takes 0 and 1 only; another byte would be a
                # bool tensor whose comparisons and sums disagree.
                raise SafetensorsError(f"{path}: tensor '{name}' of BOOL "
                                       f"holds a byte other than 0 and 1")
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
