"""The ctypes mirror of the C API (megamoe._native) against the header it mirrors,
csrc/include/megamoe/megamoe.h: every struct's fields, every function's argument and return types,
and the constants. Needs no GPU and no build."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from megamoe import _native, activation

HEADER = Path(__file__).resolve().parents[2] / "csrc" / "include" / "megamoe" / "megamoe.h"


def _header() -> str:
    text = HEADER.read_text()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _header_structs() -> dict[str, list[tuple[str, str]]]:
    structs = {}
    for body, name in re.findall(r"typedef struct \{(.*?)\}\s*(\w+);", _header(), flags=re.S):
        fields = []
        for decl in filter(None, (d.strip() for d in body.split(";"))):
            c_type, field = decl.rsplit(None, 1)
            stars = len(field) - len(field.lstrip("*"))
            fields.append((field.lstrip("*"), c_type + "*" * stars))
        structs[name] = fields
    return structs


def _header_functions() -> dict[str, tuple[str, list[str]]]:
    functions = {}
    declarations = re.sub(r"#[^\n]*", "", _header())
    for ret, name, params in re.findall(r"((?:const\s+)?\w+\s*\**)\s*\b(megamoe_\w+)\(([^)]*)\);", declarations):
        types = []
        for param in filter(None, (p.strip() for p in params.split(","))):
            if param == "void":
                continue
            c_type, arg = param.rsplit(None, 1)
            types.append(c_type + "*" * (len(arg) - len(arg.lstrip("*"))))
        functions[name] = (ret.strip(), types)
    return functions


def _c_kind(c_type: str, struct_names) -> str:
    """int32 -> 'i4', size_t -> 'u8', float -> 'f4', a pointer to a struct of the API -> its name, other
    pointers -> 'ptr'."""
    base = c_type.replace("const", "").replace(" ", "")
    if base.count("*") == 1 and base.rstrip("*") in struct_names:
        return base.rstrip("*")
    if "*" in base:
        return "ptr"
    return {"int32_t": "i4", "int": "i4", "int64_t": "i8", "size_t": "u8", "float": "f4"}.get(base, base)


def _ctypes_kind(t) -> str:
    if isinstance(t, type) and issubclass(t, ctypes.Structure):
        return t.__name__
    if isinstance(t, type) and issubclass(t, ctypes._Pointer):
        target = t._type_
        return target.__name__ if issubclass(target, ctypes.Structure) else "ptr"
    if t in (ctypes.c_void_p, ctypes.c_char_p):
        return "ptr"
    if t is ctypes.c_float:
        return "f4"
    return ("i" if t(-1).value < 0 else "u") + str(ctypes.sizeof(t))


def test_structs_match_the_header():
    header = _header_structs()
    mirrored = {s.__name__: s for s in _native.STRUCTS}
    assert sorted(mirrored) == sorted(header), "every struct of the header is mirrored, and nothing else"
    for name, fields in header.items():
        got = [(field, _ctypes_kind(t)) for field, t in mirrored[name]._fields_]
        want = [(field, _c_kind(c_type, header)) for field, c_type in fields]
        assert got == want, f"{name}: _native has {got}, the header {want}"


def test_functions_match_the_header():
    header = _header_functions()
    structs = _header_structs()
    assert sorted(_native.SIGNATURES) == sorted(header), "every function of the header is mirrored, and nothing else"
    for name, (ret, params) in header.items():
        restype, argtypes = _native.SIGNATURES[name]
        assert _ctypes_kind(restype) == _c_kind(ret, structs), f"{name}: return type"
        got = [_ctypes_kind(t) for t in argtypes]
        want = [_c_kind(p, structs) for p in params]
        assert got == want, f"{name}: _native takes {got}, the header {want}"


def _defines() -> dict[str, int]:
    return {name: int(value) for name, value in re.findall(r"#define MEGAMOE_(\w+) (-?\d+)\b", _header())}


@pytest.mark.parametrize("name", ["BLOCK_M", "MAX_PEERS", "IPC_HANDLE_BYTES", "B_N_BY_K", "B_K_BY_N", "GRAD_BF16",
                                  "GRAD_FP32", "GRAD_FP32_ADD", "FP8_ALONG_ROWS", "FP8_IN_BLOCKS",
                                  "ROWS_POOL", "ROWS_TOKENS", "SRC_BF16", "SRC_E4M3"])
def test_constants_match_the_header(name):
    assert getattr(_native, name) == _defines()[name]


def test_activations_match_the_header():
    header = {name.removeprefix("ACTIVATION_").lower(): value for name, value in _defines().items()
              if name.startswith("ACTIVATION_")}
    limited = activation.swiglu_with_limit(7.5)
    assert header == {**{name: activation.native_activation(name)[0] for name in activation.ACTIVATIONS},
                      "swiglu_limit": activation.native_activation(limited)[0]}
    assert activation.native_activation(limited) == (header["swiglu_limit"], 7.5)
    assert activation.native_activation("geglu") == (header["geglu"], 0.0)
