"""tools/safetensors_io.py on files that are not what they claim, and on
destinations that are not plain files: the reader refuses with a
SafetensorsError naming the file and the tensor (never a Python TypeError,
never a hang on a FIFO, never a silently chosen duplicate), and the writer
leaves a device or FIFO in place and a regular file intact on failure."""

import json
import os
import resource
import signal
import stat
import struct
import subprocess
import sys
import unittest

import torch

import torch_test_util as U  # noqa: E402  (sets sys.path)
import export_fx  # noqa: E402

st = export_fx._safetensors_io()


def header_file(path, header, data=b"", raw=None):
    """A safetensors file of the JSON `header` (or the bytes `raw`) and
    the data buffer `data`."""
    h = raw if raw is not None else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)
    return path


class SafetensorsReaderTest(unittest.TestCase):
    def setUp(self):
        self.dir = U.tmpdir()
        self.path = os.path.join(self.dir, "bad.safetensors")

    def refused(self, needle, header=None, data=b"", raw=None):
        header_file(self.path, header, data, raw)
        with self.assertRaises(st.SafetensorsError) as cm:
            st.read_safetensors(self.path)
        self.assertIn(self.path, str(cm.exception))
        self.assertIn(needle, str(cm.exception))

    def test_dtype_that_is_not_a_string_is_refused_naming_it(self):
        # Was TypeError: unhashable type: 'list' (a traceback).
        for dt in (["F32"], {"F32": 1}, 4, None):
            with self.subTest(dtype=dt):
                self.refused("tensor 'a' has unknown dtype",
                             {"a": {"dtype": dt, "shape": [1],
                                    "data_offsets": [0, 4]}}, b"\0" * 4)

    def test_metadata_that_is_not_an_object_is_refused(self):
        # [] and 0 were taken as "no metadata".
        for meta in ([], 0, "", False, ["k", "v"]):
            with self.subTest(metadata=meta):
                self.refused("__metadata__ is not an object of strings",
                             {"__metadata__": meta,
                              "a": {"dtype": "F32", "shape": [1],
                                    "data_offsets": [0, 4]}}, b"\0" * 4)
        # null is no metadata, unambiguously.
        header_file(self.path, {"__metadata__": None,
                                "a": {"dtype": "F32", "shape": [1],
                                      "data_offsets": [0, 4]}}, b"\0" * 4)
        self.assertEqual(st.read_safetensors(self.path)[1], {})

    def test_a_name_given_twice_is_refused(self):
        # The last entry silently won.
        entry = '{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'
        self.refused("'a' appears twice",
                     raw=f'{{"a":{entry},"a":{entry}}}'.encode(),
                     data=b"\0" * 4)

    def test_bool_bytes_other_than_zero_and_one_are_refused(self):
        self.refused("tensor 'm' of BOOL holds a byte other than 0 and 1",
                     {"m": {"dtype": "BOOL", "shape": [3],
                            "data_offsets": [0, 3]}}, b"\x01\x00\x02")
        header_file(self.path, {"m": {"dtype": "BOOL", "shape": [3],
                                      "data_offsets": [0, 3]}},
                    b"\x01\x00\x01")
        self.assertEqual(st.read(self.path)["m"].tolist(),
                         [True, False, True])

    def test_overlapping_and_lying_ranges_are_refused(self):
        f32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
        self.refused("starts at byte 4",
                     {"a": f32, "b": {"dtype": "F32", "shape": [1],
                                      "data_offsets": [4, 8]}}, b"\0" * 8)
        self.refused("has 8 bytes for shape [3]",
                     {"a": {"dtype": "F32", "shape": [3],
                            "data_offsets": [0, 8]}}, b"\0" * 8)
        self.refused("ends at byte 8 of a 4-byte data buffer",
                     {"a": f32}, b"\0" * 4)
        self.refused("over 9007199254740992 elements",
                     {"a": {"dtype": "F32", "shape": [2**40, 2**40],
                            "data_offsets": [0, 8]}}, b"\0" * 8)
        self.refused("unknown dtype 'F8_E4M3'",
                     {"a": {"dtype": "F8_E4M3", "shape": [1],
                            "data_offsets": [0, 1]}}, b"\0")
        with open(self.path, "wb") as f:
            f.write(struct.pack("<Q", 2**63))
        with self.assertRaises(st.SafetensorsError) as cm:
            st.read_safetensors(self.path)
        self.assertIn("over the 100000000 byte limit", str(cm.exception))

    def test_a_fifo_or_a_directory_is_refused_as_not_a_regular_file(self):
        fifo = os.path.join(self.dir, "pipe.safetensors")
        os.mkfifo(fifo)
        # A writer holds the FIFO open with a valid-looking length in it,
        # so that a reader that opens it goes on to read (the old reader
        # blocked in open without a writer, then misreported the size).
        fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
        try:
            os.write(fd, struct.pack("<Q", 2) + b"{}")
            for path, kind in ((fifo, "a FIFO"), (self.dir, "a directory")):
                with self.subTest(path=path):
                    with self.assertRaises(st.SafetensorsError) as cm:
                        st.read_safetensors(path)
                    self.assertIn(f"{path}: not a regular file ({kind})",
                                  str(cm.exception))
        finally:
            os.close(fd)
        missing = os.path.join(self.dir, "missing.safetensors")
        with self.assertRaises(st.SafetensorsError) as cm:
            st.read(missing)
        self.assertIn(f"{missing}: cannot open", str(cm.exception))


class SafetensorsWriterTest(unittest.TestCase):
    def setUp(self):
        self.dir = U.tmpdir()
        self.tensors = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
                        "h": torch.ones(3, dtype=torch.bfloat16)}

    def test_a_fifo_destination_is_written_not_replaced(self):
        # The rename of the atomic write replaced the FIFO (or, as root,
        # a device such as /dev/full, reported as written) with a file.
        fifo = os.path.join(self.dir, "out.safetensors")
        os.mkfifo(fifo)
        rfd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader
        try:
            n = st.write_safetensors(fifo, self.tensors)
            got = b""
            while True:
                try:
                    chunk = os.read(rfd, 1 << 16)
                except BlockingIOError:
                    break
                if not chunk:
                    break
                got += chunk
        finally:
            os.close(rfd)
        self.assertTrue(stat.S_ISFIFO(os.stat(fifo).st_mode))
        self.assertEqual(len(got), n)
        copy = os.path.join(self.dir, "copy.safetensors")
        with open(copy, "wb") as f:
            f.write(got)
        back = st.read(copy)
        for k, v in self.tensors.items():
            self.assertTrue(torch.equal(back[k], v), k)
        self.assertEqual(sorted(os.listdir(self.dir)),
                         ["copy.safetensors", "out.safetensors"])

    def test_a_replaced_file_keeps_its_permissions(self):
        # The rename gave every file 0644 (less the umask): a private 0600
        # weights file became readable by all.
        path = os.path.join(self.dir, "private.safetensors")
        st.write(path, {"old": torch.zeros(1)})
        os.chmod(path, 0o600)
        st.write(path, self.tensors)
        self.assertEqual(stat.S_IMODE(os.stat(path).st_mode), 0o600)
        fresh = os.path.join(self.dir, "fresh.safetensors")
        st.write(fresh, self.tensors)
        umask = os.umask(0)
        os.umask(umask)
        self.assertEqual(stat.S_IMODE(os.stat(fresh).st_mode), 0o644 & ~umask)

    def test_a_symlink_destination_replaces_the_file_it_names(self):
        real = os.path.join(self.dir, "real.safetensors")
        link = os.path.join(self.dir, "link.safetensors")
        st.write(real, {"old": torch.zeros(1)})
        os.symlink(real, link)
        st.write(link, self.tensors)
        self.assertTrue(os.path.islink(link))
        self.assertEqual(sorted(st.read(real)), ["h", "w"])

    def test_a_failed_write_leaves_the_destination_as_it_was(self):
        """The file size limit (RLIMIT_FSIZE) makes the write fail part of
        the way; the old file stays whole and no temporary file is left."""
        path = os.path.join(self.dir, "w.safetensors")
        st.write(path, {"old": torch.zeros(4)})
        with open(path, "rb") as f:
            before = f.read()
        script = (
            "import sys, torch\n"
            f"sys.path.insert(0, {os.path.dirname(st.__file__)!r})\n"
            "import safetensors_io as st\n"
            "try:\n"
            f"    st.write({path!r}, {{'big': torch.zeros(100000)}})\n"
            "except OSError as e:\n"
            "    print('OSError', e.errno)\n"
            "    sys.exit(3)\n")

        def limit():
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (100000, 100000))

        p = subprocess.run([sys.executable, "-c", script], capture_output=True,
                           text=True, preexec_fn=limit)
        self.assertEqual(p.returncode, 3, p.stdout + p.stderr)
        with open(path, "rb") as f:
            self.assertEqual(f.read(), before)
        self.assertEqual(os.listdir(self.dir), ["w.safetensors"])


if __name__ == "__main__":
    U.main("safetensors_io_test")
