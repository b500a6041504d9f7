"""GGUF v3: a minimal writer and reader (standard library only).

The file is: magic "GGUF", version (u32), tensor count (u64), key/value count
(u64); the key/value pairs (key as a u64-length string, value type u32, value);
one info per tensor (name, n_dims u32, dims u64 each, innermost first, ggml
type u32, data offset u64 relative to the data section); padding to the
alignment (key general.alignment, default 32); the data section, each tensor
starting at a multiple of the alignment.

Used by the peer benchmark (mkgguf.py) to write the llama.cpp model and by its
test (test_gguf.py) to read the file back.  Tensor data is produced by a
callback per tensor so that a multi-GB file never sits in memory.
"""

import struct

MAGIC = b"GGUF"
VERSION = 3
DEFAULT_ALIGNMENT = 32

# Value types of the key/value section.
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_SCALAR = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?",
           U64: "<Q", I64: "<q", F64: "<d"}

# ggml tensor types this benchmark writes: (type id, elements per block, bytes per block).
GGML_F32 = 0
GGML_Q8_0 = 8
GGML_BF16 = 30
GGML_MXFP4 = 39
TYPE_BLOCK = {GGML_F32: (1, 4), GGML_Q8_0: (32, 34), GGML_BF16: (1, 2), GGML_MXFP4: (32, 17)}
TYPE_NAME = {GGML_F32: "F32", GGML_Q8_0: "Q8_0", GGML_BF16: "BF16", GGML_MXFP4: "MXFP4"}


def tensor_nbytes(ggml_type, dims):
    """Bytes of a tensor of `dims` (innermost first); the innermost dim must be whole blocks."""
    per, size = TYPE_BLOCK[ggml_type]
    if dims[0] % per:
        raise ValueError(f"innermost dim {dims[0]} is not a multiple of the block size {per}")
    n = 1
    for d in dims:
        n *= d
    return n // per * size


def _align(n, a):
    return (n + a - 1) // a * a


def _str(s):
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _value(vtype, v):
    if vtype == STRING:
        return _str(v)
    if vtype == ARRAY:
        etype, items = v
        out = [struct.pack("<IQ", etype, len(items))]
        if etype == STRING:
            out.extend(_str(s) for s in items)
        else:
            out.append(struct.pack("<%d%s" % (len(items), _SCALAR[etype][1]), *items))
        return b"".join(out)
    return struct.pack(_SCALAR[vtype], v)


class Writer:
    """kv: list of (key, type, value); an ARRAY value is (element type, list).
    Tensors: add(name, ggml_type, dims, produce) where produce(f) writes exactly
    the tensor's bytes to the file object f."""

    def __init__(self, alignment=DEFAULT_ALIGNMENT):
        self.kv = []
        self.tensors = []
        self.alignment = alignment
        if alignment != DEFAULT_ALIGNMENT:
            self.kv.append(("general.alignment", U32, alignment))

    def add_kv(self, key, vtype, value):
        self.kv.append((key, vtype, value))

    def add_tensor(self, name, ggml_type, dims, produce):
        self.tensors.append((name, ggml_type, list(dims), produce))

    def write(self, path):
        head = [MAGIC, struct.pack("<IQQ", VERSION, len(self.tensors), len(self.kv))]
        for key, vtype, value in self.kv:
            head.append(_str(key) + struct.pack("<I", vtype) + _value(vtype, value))
        offset = 0
        sizes = []
        for name, gtype, dims, _ in self.tensors:
            n = tensor_nbytes(gtype, dims)
            sizes.append(n)
            head.append(_str(name) + struct.pack("<I", len(dims)) + struct.pack("<%dQ" % len(dims), *dims) +
                        struct.pack("<IQ", gtype, offset))
            offset = _align(offset + n, self.alignment)
        blob = b"".join(head)
        with open(path, "wb") as f:
            f.write(blob)
            f.write(b"\0" * (_align(len(blob), self.alignment) - len(blob)))
            base = f.tell()
            for (name, _, _, produce), n in zip(self.tensors, sizes):
                f.write(b"\0" * (base + _align(f.tell() - base, self.alignment) - f.tell()))
                start = f.tell()
                produce(f)
                if f.tell() - start != n:
                    raise ValueError(f"tensor {name}: produced {f.tell() - start} bytes, expected {n}")
            f.write(b"\0" * (base + _align(f.tell() - base, self.alignment) - f.tell()))


class ParseError(Exception):
    pass


class Reader:
    """Parses a GGUF v3 file's header: .kv (dict key -> value), .tensors (list
    of dicts name/type/dims/offset/nbytes), .data_offset; checks what a loader
    relies on: magic, version, bounds, unique names, aligned non-overlapping
    tensors inside the file."""

    def __init__(self, path):
        with open(path, "rb") as f:
            self.buf = f.read()
        self.pos = 0
        if self._take(4) != MAGIC:
            raise ParseError(f"{path}: not a GGUF file (bad magic)")
        version, n_tensors, n_kv = struct.unpack("<IQQ", self._take(20))
        if version != VERSION:
            raise ParseError(f"{path}: GGUF version {version}, expected {VERSION}")
        self.kv = {}
        for _ in range(n_kv):
            key = self._string()
            if key in self.kv:
                raise ParseError(f"{path}: duplicate key {key}")
            (vtype,) = struct.unpack("<I", self._take(4))
            self.kv[key] = self._read_value(vtype)
        self.alignment = self.kv.get("general.alignment", DEFAULT_ALIGNMENT)
        self.tensors = []
        names = set()
        for _ in range(n_tensors):
            name = self._string()
            if name in names:
                raise ParseError(f"{path}: duplicate tensor {name}")
            names.add(name)
            (nd,) = struct.unpack("<I", self._take(4))
            if not 1 <= nd <= 4:
                raise ParseError(f"{path}: tensor {name}: {nd} dims")
            dims = list(struct.unpack("<%dQ" % nd, self._take(8 * nd)))
            gtype, off = struct.unpack("<IQ", self._take(12))
            if gtype not in TYPE_BLOCK:
                raise ParseError(f"{path}: tensor {name}: unexpected ggml type {gtype}")
            if off % self.alignment:
                raise ParseError(f"{path}: tensor {name}: offset {off} not aligned to {self.alignment}")
            self.tensors.append({"name": name, "type": gtype, "dims": dims, "offset": off,
                                 "nbytes": tensor_nbytes(gtype, dims)})
        self.data_offset = _align(self.pos, self.alignment)
        end = 0
        for t in sorted(self.tensors, key=lambda t: t["offset"]):
            if t["offset"] < end:
                raise ParseError(f"{path}: tensor {t['name']} overlaps the one before it")
            end = t["offset"] + t["nbytes"]
        if self.data_offset + end > len(self.buf):
            raise ParseError(f"{path}: tensor data runs past the end of the file")

    def tensor_bytes(self, name):
        for t in self.tensors:
            if t["name"] == name:
                start = self.data_offset + t["offset"]
                return self.buf[start:start + t["nbytes"]]
        raise KeyError(name)

    def _take(self, n):
        if self.pos + n > len(self.buf):
            raise ParseError(f"truncated at byte {self.pos} (wanted {n} more)")
        b = self.buf[self.pos:self.pos + n]
        self.pos += n
        return b

    def _string(self):
        (n,) = struct.unpack("<Q", self._take(8))
        return self._take(n).decode("utf-8")

    def _read_value(self, vtype):
        if vtype == STRING:
            return self._string()
        if vtype == ARRAY:
            etype, n = struct.unpack("<IQ", self._take(12))
            if etype == STRING:
                return [self._string() for _ in range(n)]
            if etype not in _SCALAR:
                raise ParseError(f"array of type {etype}")
            fmt = _SCALAR[etype][1]
            return list(struct.unpack("<%d%s" % (n, fmt), self._take(n * struct.calcsize(fmt))))
        if vtype not in _SCALAR:
            raise ParseError(f"value type {vtype}")
        fmt = _SCALAR[vtype]
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]
