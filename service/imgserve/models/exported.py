"""Whether a torch.export archive (.pt2) is only what torch.export.save writes for an ordinary model.

`torch.export.load` runs code an archive can carry: it unpickles some entries (weights_only=False), loads compiled
AOTInductor libraries, evaluates SymPy strings (eval), compiles the shape guards as Python, writes parameter names
into generated Python, and calls any torch callable a graph node names. `unsafe_reason` reads the archive the way
torch does and accepts only the plain form: raw tensor data, JSON, sample inputs that load with weights_only=True,
ATen/prims/torchvision operators, and SymPy, guard, pytree and name strings of the shapes torch writes. Anything
else, including formats this check does not know, is refused (it fails closed). It follows the archive of the torch
the image installs (2.13); where another torch writes or reads a different one, a .pt2 needs --trust-pickle.
"""

from __future__ import annotations

import ast
import io
import json
import re
import zipfile
from typing import Any

import torch

# The entries torch.export.save writes for one model (under the archive's root folder), besides extra/ files.
ROOT_ENTRIES = {"archive_format", "archive_version", "byteorder", ".data/version", ".data/serialization_id"}
PROGRAM, SAMPLE_INPUTS = "models/model.json", "data/sample_inputs/model.pt"
CONFIGS = {"data/weights/model_weights_config.json": "weight_", "data/constants/model_constants_config.json": "tensor_"}
TENSOR_FILE = re.compile(r"data/(weights/weight|constants/tensor)_[0-9]+")

# Strings of the program, by the key that holds them.
NAME = re.compile(r"[A-Za-z0-9_.:-]*")  # names torch may write into generated code: no quotes, brackets or spaces
FREE_TEXT = {"stack_trace", "nn_module_stack", "source_fn_stack", "torch_fn", "custom", "from_node", "torch_version"}
LITERALS = {"as_string", "as_strings"}  # an operator's string arguments: written into generated code with repr()
ANY_KEYS = {"range_constraints", "as_string_to_argument"}  # maps whose keys are only looked up

# Graph nodes: operator overloads of these namespaces (except file access), and torch's symbolic-shape operators.
NAMESPACES = {"aten", "prims", "torchvision"}
FILE_OPERATORS = {"aten::save", "aten::from_file"}
SYM_FUNCTIONS = {"torch.sym_int", "torch.sym_float", "torch.sym_ite", "torch.sym_max", "torch.sym_min"}
SYM_FUNCTIONS |= {"torch.sym_not", "torch.sym_sqrt", "math.trunc"}
SYM_OPERATORS = {f"_operator.{name}" for name in ("add", "sub", "mul", "floordiv", "truediv", "mod", "pow", "neg")}
SYM_OPERATORS |= {f"_operator.{name}" for name in ("pos", "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_")}
SYM_OPERATORS |= {"_operator.lshift", "_operator.rshift", *SYM_FUNCTIONS}

# Shape expressions (SymPy srepr, evaluated by sympify) and guards (Python source, compiled): what torch writes.
WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SYMBOL_OR_NUMBER = re.compile(r"[a-z]+[0-9]+|[-+0-9.eE/]+")  # s77, -1, 1.5, 1/3
SYMPY_CALLS = {"Symbol", "Integer", "Rational", "Float", "Add", "Mul", "Pow", "Max", "Min", "Mod", "Abs", "floor"}
SYMPY_CALLS |= {"ceiling", "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "StrictLessThan", "StrictGreaterThan", "LessThan"}
SYMPY_CALLS |= {"GreaterThan", "Equality", "Unequality", "And", "Or", "Not", "Piecewise", "ExprCondPair", "Tuple"}
SYMPY_CALLS |= {"FloorDiv", "ModularIndexing", "Where", "PythonMod", "CleanDiv", "CeilToInt", "FloorToInt", "CeilDiv"}
SYMPY_CALLS |= {"LShift", "RShift", "PowByNatural", "FloatPow", "FloatTrueDiv", "IntTrueDiv", "TruncToFloat"}
SYMPY_CALLS |= {"TruncToInt", "RoundToInt", "RoundDecimal", "ToFloat", "Identity"}
SYMPY_NAMES = {"oo", "zoo", "nan", "true", "false", "int_oo"}
TENSOR_METHODS = {"size", "stride", "storage_offset", "dim", "numel"}
MATH = ("floor", "ceil", "trunc", "sqrt", "cos", "cosh", "acos", "sin", "sinh", "asin", "tan", "tanh", "atan", "log2")
GUARD_CALLS = {"max", "min", "abs", "round", "torch._sym_sqrt", *(f"math.{name}" for name in MATH), *SYM_FUNCTIONS}
GUARD_CALLS |= {"IsNonOverlappingAndDenseIndicator"}
GUARD_VALUES = {"L", "inf", "math", "torch", "math.inf", "math.nan"}
OPERATORS: tuple[type[ast.AST], ...] = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)
OPERATORS += (ast.USub, ast.UAdd, ast.Not)
OPERATORS += (ast.And, ast.Or, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.BitAnd, ast.BitOr)
OPERATORS += (ast.BitXor, ast.Invert, ast.LShift, ast.RShift)

# Input and output structures: containers whose context torch parses as JSON without importing anything.
PYTREE_TYPES = {"builtins.tuple", "builtins.list", "builtins.dict", "collections.OrderedDict"}
PYTREE_TYPES |= {"torch.fx.immutable_collections.immutable_list", "torch.fx.immutable_collections.immutable_dict"}


class Refused(ValueError):
    """The archive holds something torch.export.load could run; the message says what."""


def unsafe_reason(data: bytes) -> str | None:
    """Why loading the .pt2 archive `data` with torch.export.load could run code from it; None when it is plain."""
    try:
        _check_archive(data)
    except Refused as exc:
        return str(exc)
    except Exception as exc:  # unreadable for the reader torch uses: not a plain archive either
        return f"it is not a torch.export archive this torch reads ({type(exc).__name__})"
    return None


def _check_archive(data: bytes) -> None:
    from torch.export.pt2_archive import PT2ArchiveReader  # torch's own reader (torch >= 2.7)

    reader = PT2ArchiveReader(io.BytesIO(data))
    names = reader.get_file_names()
    _check_entries(names, zipfile.ZipFile(io.BytesIO(data)).namelist())
    for config, prefix in CONFIGS.items():
        for fqn, payload in json.loads(reader.read_string(config))["config"].items():
            if payload.get("use_pickle") is not False or not str(payload.get("path_name")).startswith(prefix):
                raise Refused(f"{str(fqn)[:60]!r} is a pickled object, not raw tensor data")
    if SAMPLE_INPUTS in names and reader.read_bytes(SAMPLE_INPUTS):
        try:  # torch tries weights_only=True first and falls back to a full unpickle: only the first may succeed
            torch.load(io.BytesIO(reader.read_bytes(SAMPLE_INPUTS)), weights_only=True)
        except Exception:
            raise Refused("its sample inputs are a pickle that does not load with weights_only=True") from None
    _check_program(json.loads(reader.read_string(PROGRAM)))


def _check_entries(names: list[str], zip_names: list[str]) -> None:
    """Only the entries torch.export.save writes for one model, seen alike by torch's zip reader and Python's (torch
    falls back to reading an older format with the latter)."""
    roots = {name.partition("/")[0] for name in zip_names}
    same = sorted(name.partition("/")[2] for name in zip_names) == sorted(names)
    if len(set(names)) != len(names) or len(roots) != 1 or not same:
        raise Refused("its zip directory names an entry twice or differently for different readers")
    for name in names:
        known = name in ROOT_ENTRIES or name in CONFIGS or name in (PROGRAM, SAMPLE_INPUTS)
        if not (known or TENSOR_FILE.fullmatch(name) or name.startswith("extra/")):
            raise Refused(f"it holds {name[:60]!r}, which torch.export.save does not write for a plain model")


def _check_program(value: Any, key: str = "") -> None:
    """Every string of the program that torch evaluates, compiles or writes into code has the form torch writes."""
    if isinstance(value, dict):
        for child_key, child in value.items():
            if key not in ANY_KEYS and not NAME.fullmatch(child_key):
                raise Refused(f"its program has a key {child_key[:60]!r} torch does not write")
            if child_key not in FREE_TEXT and child_key not in LITERALS:
                _check_program(child, child_key)
    elif isinstance(value, list):
        for child in value:
            _check_program(child, key)
    elif isinstance(value, str):
        _check_string(value, key)


def _check_string(text: str, key: str) -> None:
    if key in ("target", "as_operator"):
        _check_operator(text)
    elif key == "expr_str":
        _check_expression(text, _sympy_node, "a shape expression")
    elif key == "guards_code":
        _check_expression(text, _guard_node, "a shape guard")
    elif key in ("in_spec", "out_spec"):
        _check_pytree(text)
    elif not NAME.fullmatch(text):
        raise Refused(f"its {key or 'program'} names {text[:60]!r}, which torch would write into generated code")


def _check_operator(target: str) -> None:
    """An ATen, prims or torchvision operator overload that touches no file, or a symbolic-shape operator."""
    if target in SYM_OPERATORS:
        return
    parts = target.split(".")
    if len(parts) == 5 and parts[:2] == ["torch", "ops"] and parts[2] in NAMESPACES and all(map(WORD.fullmatch, parts)):
        operator = getattr(getattr(getattr(torch.ops, parts[2]), parts[3], None), parts[4], None)
        if isinstance(operator, torch._ops.OpOverload) and operator._schema.name not in FILE_OPERATORS:
            return
    raise Refused(f"a graph node calls {target[:80]!r}, which is not an ATen operator")


def _check_expression(text: str, allowed: Any, what: str) -> None:
    if not text.isascii() or any(char in text for char in "#;\\\n\r"):
        raise Refused(f"{what} {text[:60]!r} is not an expression torch writes")
    try:
        nodes = list(ast.walk(ast.parse(text, mode="eval")))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise Refused(f"{what} {text[:60]!r} is not an expression torch writes") from None
    callees = {id(node.func) for node in nodes if isinstance(node, ast.Call)}
    for node in nodes:
        if not (isinstance(node, ast.expr_context | ast.Expression) or allowed(node, id(node) in callees)):
            raise Refused(f"{what} {text[:60]!r} is not an expression torch writes ({type(node).__name__})")


def _sympy_node(node: ast.AST, called: bool) -> bool:
    """SymPy's srepr of a shape: calls of SymPy classes on numbers, symbol names and assumptions."""
    if isinstance(node, ast.Call):
        return isinstance(node.func, ast.Name) and node.func.id in SYMPY_CALLS
    if isinstance(node, ast.Name):  # a callee (checked above) or a constant such as oo
        return called or node.id in SYMPY_NAMES
    if isinstance(node, ast.keyword):
        return bool(node.arg and WORD.fullmatch(node.arg))
    if isinstance(node, ast.Constant):
        value = node.value
        return type(value) in (int, float, bool) or (isinstance(value, str) and bool(SYMBOL_OR_NUMBER.fullmatch(value)))
    return isinstance(node, (ast.UnaryOp, ast.BinOp, ast.Compare, ast.BoolOp, ast.Tuple, *OPERATORS))


def _guard_node(node: ast.AST, called: bool) -> bool:
    """Arithmetic and comparisons of an input's sizes, strides and offset (L['x'].size()[0] >= 2), through the
    functions torch's guard printer writes (max, math.trunc, torch.sym_float)."""
    if isinstance(node, ast.Name | ast.Attribute) and called:
        return _dotted(node) in GUARD_CALLS or (isinstance(node, ast.Attribute) and node.attr in TENSOR_METHODS)
    if isinstance(node, ast.Name | ast.Attribute):
        return _dotted(node) in GUARD_VALUES
    if isinstance(node, ast.Call):
        method = isinstance(node.func, ast.Attribute) and node.func.attr in TENSOR_METHODS
        return not node.keywords and (_dotted(node.func) in GUARD_CALLS or (method and not node.args))
    if isinstance(node, ast.Constant):
        value = node.value
        return type(value) in (int, float, bool) or (isinstance(value, str) and bool(WORD.fullmatch(value)))
    return isinstance(node, (ast.UnaryOp, ast.BinOp, ast.Compare, ast.BoolOp, ast.Subscript, *OPERATORS))


def _dotted(node: ast.AST) -> str:
    """`math.trunc` for that attribute of that name; '' for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return f"{node.value.id}.{node.attr}"
    return ""


def _check_pytree(text: str) -> None:
    """A pytree spec of tuples, lists and dicts keyed by names or numbers (torch imports the module an enum key names,
    and writes a dict's keys into the generated forward() as argument names)."""
    try:
        protocol, spec = json.loads(text)
    except (ValueError, TypeError):
        raise Refused("its input or output structure is not a pytree spec torch writes") from None
    pending = [spec] if protocol == 1 else [None]
    while pending:
        node = pending.pop()
        if not isinstance(node, dict) or set(node) != {"type", "context", "children_spec"}:
            raise Refused("its input or output structure is not a pytree spec torch writes")
        kind, context, children = node["type"], node["context"], node["children_spec"]
        if kind is None and context is None and children == []:
            continue
        keys = json.loads(context) if kind in PYTREE_TYPES and isinstance(context, str) else {}
        if not (keys is None or isinstance(keys, list)) or not isinstance(children, list):
            raise Refused(f"its input or output structure holds a {str(kind)[:60]!r}, not a tuple, list or dict")
        if not all(type(key) is int or (isinstance(key, str) and NAME.fullmatch(key)) for key in keys or []):
            raise Refused("its input or output structure has a dict key that is not a plain name")
        pending.extend(children)
