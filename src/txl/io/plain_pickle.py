"""Read plain data out of a pickle stream without executing anything (for Hugging Face's `vocab.pkl`).

Python's own unpickler calls whatever callable a file names (`os.system`, `builtins.eval`, any class's
`__reduce__`): that is CVE-2023-6730, the hole that got Hugging Face's TransfoXL tokenizer deprecated.
This module is a small interpreter of the pickle opcodes (protocols 0-5) that builds only plain data:
dict, list, tuple, set, str, bytes, int, float, bool, None, `collections.Counter` and
`collections.OrderedDict`. It imports nothing and calls nothing a file names:

- Counter and OrderedDict are built by this module from the data, not by calling the named global.
- A short list of globals that a tokenizer's pickled `__dict__` is known to hold (compiled regexes,
  sacremoses normaliser/tokeniser/detokeniser objects, transformers' `Trie`, tokenizers' `AddedToken`,
  `copyreg._reconstructor`) become inert `Opaque` placeholders that record the name and arguments.
- Any other global (`os.system`, `subprocess.Popen`, `builtins.eval`, a class of the file's own) is
  refused at the opcode that names it, before anything else happens.

Its work is bounded, so a hostile file is refused in one line instead of exhausting memory, time or
the stack (issue 50): the stream size, the number of opcodes, of containers (empty ones included), of
objects on the stack and of memo entries, the nesting depth of containers, the number of items they
would hold if shared containers were expanded (the "billion laughs" bomb built from memo references),
and the hashing of dictionary keys and set members: a tuple does not cache its hash, so a key's
expanded size is checked before it is hashed, and all keys together may not cost more than a budget.
A message quotes a value only as a short summary (`brief`).

Size: one interpreter of the pickle opcodes with its bounds on work; the opcode table is reviewed
whole (a security boundary: CVE-2023-6730), so it is not split.
"""

from __future__ import annotations

import codecs
import struct
from collections import Counter, OrderedDict
from typing import Any

from txl.errors import DataError

# The limits, against what transfo-xl-wt103's vocabulary (267,735 words) needs in transformers 4.35's
# layout: 8 MB, 1.6M opcodes, 99 containers, 268k memo entries, 1.3M expanded items, 13 deep.
# lm1b's 793k words would need about three times as much.
MAX_BYTES = 256 << 20
MAX_OPS = 16_000_000  # opcodes executed
MAX_CONTAINERS = 200_000  # containers built, empty ones included (10 MB of EMPTY_SET were 3.1 GB)
MAX_STACK = 1_000_000  # objects on the stack at once (a vocabulary batches its items 1,000 at a time)
MAX_MEMO = 4_000_000  # memo entries
MAX_DEPTH = 64  # a tokenizer's __dict__ nests about 13 deep
MAX_ITEMS = MAX_OPS  # items held by containers, counting shared containers once per use: without
# sharing a stream of MAX_OPS opcodes cannot hold more, so sharing buys a bomb nothing
MAX_KEY_ITEMS = 1_000  # expanded items of one dictionary key or set member (a vocabulary's keys are strings)
MAX_HASHED = MAX_OPS  # expanded items hashed as keys and set members, all together
MAX_INT_BYTES = 64  # LONG1/LONG4/LONG: no vocabulary needs integers of more than 512 bits
BRIEF_CHARS = 80  # the longest quotation of a value in a message

# Globals whose objects a tokenizer's __dict__ holds and which we keep as inert placeholders.
_INERT_MODULE_PREFIXES = ("sacremoses.",)
_INERT = {
    ("re", "_compile"),
    ("copyreg", "_reconstructor"),
    ("copy_reg", "_reconstructor"),
    ("builtins", "object"),
    ("__builtin__", "object"),
    ("transformers.tokenization_utils", "Trie"),
    ("tokenizers", "AddedToken"),
}
_BUILT_HERE = {
    ("collections", "OrderedDict"): "OrderedDict",
    ("collections", "Counter"): "Counter",
    ("builtins", "set"): "set",
    ("builtins", "frozenset"): "frozenset",
    ("__builtin__", "set"): "set",
    ("__builtin__", "frozenset"): "frozenset",
    ("_codecs", "encode"): "bytes",  # protocols 0-2 write bytes as _codecs.encode(text, "latin1")
}


class PickleRefused(DataError):
    """The stream names code, is malformed, or exceeds a bound; nothing from it was executed."""


class Opaque:
    """An inert stand-in for an object of an allowed-but-ignored class (never constructed)."""

    __slots__ = ("args", "name", "state")

    def __init__(self, name: str, args: Any = None):
        self.name = name
        self.args = args
        self.state: Any = None

    def __repr__(self) -> str:
        return f"<opaque {self.name}>"


class _Global:
    """A global named by GLOBAL/STACK_GLOBAL: a name, never a Python object."""

    __slots__ = ("kind", "name")

    def __init__(self, module: str, name: str):
        self.name = f"{module}.{name}"
        self.kind = _BUILT_HERE.get((module, name))
        if self.kind is None and not ((module, name) in _INERT or module.startswith(_INERT_MODULE_PREFIXES)):
            raise PickleRefused(f"it refers to the Python object {_cut(self.name)}, and unpickling it could run code")


_CONTAINERS = (list, dict, set, tuple, frozenset, Opaque)


def _cut(text: str, limit: int = BRIEF_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def brief(value: Any, *, _level: int = 0) -> str:
    """A short summary of `value` for a message (at most BRIEF_CHARS): two levels deep, four items per
    container, strings cut. Never `repr()` of the whole: a 231-byte file of shared lists expands to a
    100 MB repr, and repr() of a Counter or OrderedDict subclass is not bounded by `reprlib` either."""
    if isinstance(value, str | bytes):
        text = repr(value[:40]) + ("..." if len(value) > 40 else "")
    elif isinstance(value, dict | list | tuple | set | frozenset):
        if isinstance(value, dict):
            opening, closing = "{", "}"
        elif isinstance(value, list):
            opening, closing = "[", "]"
        elif isinstance(value, tuple):
            opening, closing = "(", ")"
        else:
            opening, closing = type(value).__name__ + "({", "})"
        if not value:
            return opening + closing
        if _level >= 2:
            return opening + "..." + closing
        shown = []
        for i, item in enumerate(value.items() if isinstance(value, dict) else value):
            if i == 4:
                shown.append("...")
                break
            if isinstance(value, dict):
                shown.append(f"{brief(item[0], _level=_level + 1)}: {brief(item[1], _level=_level + 1)}")
            else:
                shown.append(brief(item, _level=_level + 1))
        text = opening + ", ".join(shown) + ("," if isinstance(value, tuple) and len(value) == 1 else "") + closing
    elif value is None or isinstance(value, bool | int | float):
        text = repr(value) if not isinstance(value, int) or value.bit_length() < 200 else "<a large integer>"
    elif isinstance(value, Opaque):
        text = f"<opaque {_cut(value.name, 40)}>"
    else:
        text = f"<{type(value).__name__}>"
    return _cut(text)


def _hash_each(items: list[Any]) -> None:
    """Hash keys or set members whose size `_Reader.keys` has checked (a tuple holding a list raises)."""
    for item in items:
        try:
            hash(item)
        except TypeError:
            raise PickleRefused("it is malformed (an unhashable key or set member)") from None


def read_plain_pickle(data: bytes) -> Any:
    """The object of the pickle stream `data`, built from plain data only; `PickleRefused` otherwise."""
    return read_plain_pickle_at(data, 0)[0]


def read_plain_pickle_at(data: bytes, offset: int) -> tuple[Any, int]:
    """The object of the pickle that starts at byte `offset` of `data`, and the offset after its STOP
    (files written by the legacy `torch.save` are several pickles in a row)."""
    reader = _Reader(data, offset)
    return reader.run(), reader.pos


class _Reader:
    def __init__(self, data: bytes, offset: int = 0):
        if len(data) > MAX_BYTES:
            raise PickleRefused(f"it is {len(data):,} bytes, more than the {MAX_BYTES:,} a vocabulary may have")
        self.data = bytes(data)
        self.pos = offset
        self.stack: list[Any] = []
        self.marks: list[int] = []
        self.memo: dict[int, Any] = {}
        # depth and expanded size of every container that has items (keyed by id; `keep` holds them alive,
        # so that an id in `shape` stays theirs); an empty one is (1, 1) and costs no bookkeeping
        self.shape: dict[int, tuple[int, int]] = {}
        self.keep: list[Any] = []
        self.containers = 0
        self.hashed = 0  # expanded items hashed as keys so far

    # ---- reading the stream ----------------------------------------------------------------
    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise PickleRefused("it is truncated or malformed (a length runs past the end of the stream)")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def line(self) -> bytes:
        end = self.data.find(b"\n", self.pos, self.pos + (1 << 20))
        if end < 0:
            raise PickleRefused("it is truncated or malformed (an unterminated text argument)")
        return self.take(end + 1 - self.pos)[:-1]

    def uint(self, n: int) -> int:
        return int.from_bytes(self.take(n), "little")

    # ---- bookkeeping for the bounds -------------------------------------------------------------
    def new(self, obj: Any) -> Any:
        self.count_container()
        return obj

    def count_container(self) -> None:
        """Every container counts, empty ones and the shared empty tuple too."""
        self.containers += 1
        if self.containers > MAX_CONTAINERS:
            raise PickleRefused(f"it builds more than {MAX_CONTAINERS:,} containers (a pickle bomb?)")

    def size_of(self, obj: Any) -> tuple[int, int]:
        return self.shape.get(id(obj), (1, 1)) if isinstance(obj, _CONTAINERS) else (0, 1)

    def grow(self, parent: Any, children: list[Any]) -> None:
        old = self.shape.get(id(parent))
        if old is None:
            self.keep.append(parent)
        depth, size = old or (1, 1)
        for child in children:
            child_depth, child_size = self.size_of(child)
            depth = max(depth, child_depth + 1)
            size += child_size
        if depth > MAX_DEPTH:
            raise PickleRefused(f"its containers nest more than {MAX_DEPTH} deep (a pickle bomb?)")
        if size > MAX_ITEMS:
            raise PickleRefused(f"its containers expand to more than {MAX_ITEMS:,} items (a pickle bomb?)")
        self.shape[id(parent)] = (depth, size)

    def pop_mark(self) -> list[Any]:
        if not self.marks:
            raise PickleRefused("it is malformed (no MARK before an opcode that needs one)")
        start = self.marks.pop()
        items = self.stack[start:]
        del self.stack[start:]
        return items

    def pop(self) -> Any:
        if not self.stack or (self.marks and len(self.stack) <= self.marks[-1]):
            raise PickleRefused("it is malformed (stack underflow)")
        return self.stack.pop()

    def top(self) -> Any:
        if not self.stack:
            raise PickleRefused("it is malformed (stack underflow)")
        return self.stack[-1]

    # ---- building -------------------------------------------------------------------------------
    def container(self, kind: str, items: list[Any]) -> Any:
        obj: Any
        if kind == "tuple":
            obj = self.new(tuple(items))
        elif kind == "list":
            obj = self.new(list(items))
        elif kind == "frozenset":
            obj = self.new(frozenset(self.keys(items)))
        else:
            raise AssertionError(kind)
        self.grow(obj, items)
        return obj

    def keys(self, items: list[Any]) -> list[Any]:
        """`items` as dictionary keys or set members: their expanded sizes are checked first, and only
        then are they hashed (hashing a tuple visits every item it holds, every time)."""
        total = 0
        others = []
        for item in items:
            if type(item) is str:  # a vocabulary's keys: one item, hashed once (str caches its hash)
                total += 1
                continue
            if isinstance(item, Opaque | _Global):
                raise PickleRefused("it is malformed (an object as a key or set member)")
            size = self.size_of(item)[1]
            if size > MAX_KEY_ITEMS:
                raise PickleRefused(f"it has a dictionary key or set member of more than {MAX_KEY_ITEMS:,} items "
                                    "(a pickle bomb?)")
            total += size
            others.append(item)
        self.hashed += total
        if self.hashed > MAX_HASHED:
            raise PickleRefused(f"it hashes more than {MAX_HASHED:,} key items (a pickle bomb?)")
        _hash_each(others)
        return items

    def setitems(self, target: Any, items: list[Any]) -> None:
        if len(items) % 2:
            raise PickleRefused("it is malformed (SETITEMS with an odd number of items)")
        if isinstance(target, Opaque):  # e.g. OrderedDict state of an ignored object
            self.grow(target, items)
            return
        if not isinstance(target, dict):
            raise PickleRefused(f"it is malformed (SETITEM on a {_cut(type(target).__name__)})")
        keys = self.keys(items[0::2])
        self.grow(target, items)
        for key, value in zip(keys, items[1::2]):
            target[key] = value

    def appends(self, target: Any, items: list[Any]) -> None:
        if isinstance(target, Opaque):
            self.grow(target, items)
            return
        if not isinstance(target, list):
            raise PickleRefused(f"it is malformed (APPEND on a {type(target).__name__})")
        self.grow(target, items)
        target.extend(items)

    def call(self, func: Any, args: Any) -> Any:
        """REDUCE/NEWOBJ: build a Counter/OrderedDict/set from data, or an inert placeholder."""
        if not isinstance(func, _Global | Opaque):
            raise PickleRefused("it is malformed (REDUCE of something that is not a global)")
        if not isinstance(args, tuple):
            raise PickleRefused("it is malformed (REDUCE arguments are not a tuple)")
        kind = func.kind if isinstance(func, _Global) else None
        if kind in ("OrderedDict", "Counter"):
            obj = self.new(OrderedDict() if kind == "OrderedDict" else Counter())
            if args:
                source = args[0]
                if not isinstance(source, dict) or len(args) > 1:
                    raise PickleRefused(f"it is malformed ({kind} built from a {type(source).__name__})")
                self.keys(list(source))  # hashed again by update()
                obj.update(source)
                self.grow(obj, [source])
            return obj
        if kind in ("set", "frozenset"):
            items = list(args[0]) if args and isinstance(args[0], list | tuple | set | frozenset) else []
            obj = self.new(set(self.keys(items)) if kind == "set" else frozenset(self.keys(items)))
            self.grow(obj, items)
            return obj
        if kind == "bytes":
            if len(args) != 2 or not isinstance(args[0], str) or args[1] not in ("latin1", "latin-1"):
                raise PickleRefused("it is malformed (bytes encoded other than as Latin-1)")
            return args[0].encode("latin-1")
        obj = self.new(Opaque(func.name, args))
        self.grow(obj, [args])
        return obj

    def build(self, obj: Any, state: Any) -> None:
        """BUILD: set the state of an object. Only placeholders and plain dicts take state."""
        if isinstance(obj, Opaque):
            obj.state = state
            self.grow(obj, [state])
        elif isinstance(obj, dict) and isinstance(state, dict):
            self.setitems(obj, [x for kv in state.items() for x in kv])
        else:
            raise PickleRefused(f"it is malformed (BUILD on a {type(obj).__name__})")

    # ---- the interpreter ----------------------------------------------------------------------
    def run(self) -> Any:  # one branch per opcode reads best as one function
        stack = self.stack
        push = stack.append
        ops, max_ops, max_stack = 0, MAX_OPS, MAX_STACK
        while True:
            if self.pos >= len(self.data):
                raise PickleRefused("it is truncated (no STOP opcode)")
            ops += 1
            if ops > max_ops:
                raise PickleRefused(f"it runs more than {max_ops:,} opcodes (a pickle bomb?)")
            if len(stack) > max_stack:
                raise PickleRefused(f"it holds more than {max_stack:,} objects on its stack (a pickle bomb?)")
            op = self.data[self.pos]
            self.pos += 1
            # -- the most frequent opcodes of a vocabulary first: strings, the memo, small ints
            if op in (0x58, 0x8C, 0x8D):  # BINUNICODE, SHORT_BINUNICODE, BINUNICODE8
                n = self.uint({0x58: 4, 0x8C: 1, 0x8D: 8}[op])
                try:
                    push(self.take(n).decode("utf-8", "surrogatepass"))
                except UnicodeDecodeError:
                    raise PickleRefused("it is malformed (a string that is not UTF-8)") from None
            elif op in (0x70, 0x71, 0x72, 0x94):  # PUT, BINPUT, LONG_BINPUT, MEMOIZE
                if op == 0x94:
                    key = len(self.memo)
                elif op == 0x70:
                    key = self._line_int()
                else:
                    key = self.uint(1 if op == 0x71 else 4)
                if len(self.memo) >= MAX_MEMO and key not in self.memo:
                    raise PickleRefused(f"it has more than {MAX_MEMO:,} memo entries (a pickle bomb?)")
                self.memo[key] = self.top()
            elif op in (0x67, 0x68, 0x6A):  # GET, BINGET, LONG_BINGET
                key = self._line_int() if op == 0x67 else self.uint(1 if op == 0x68 else 4)
                if key not in self.memo:
                    raise PickleRefused("it is malformed (a memo reference to nothing)")
                push(self.memo[key])
            elif op == 0x4B:  # BININT1
                push(self.uint(1))
            elif op == 0x4D:  # BININT2
                push(self.uint(2))
            elif op == 0x4A:  # BININT
                push(int.from_bytes(self.take(4), "little", signed=True))
            elif op == 0x80:  # PROTO
                if self.uint(1) > 5:
                    raise PickleRefused("it uses a pickle protocol newer than 5")
            elif op == 0x95:  # FRAME
                self.uint(8)
            elif op == 0x2E:  # STOP
                if len(self.stack) != 1 or self.marks:
                    raise PickleRefused("it is malformed (STOP with a stack that is not one object)")
                return self.stack[0]
            elif op == 0x28:  # MARK
                self.marks.append(len(self.stack))
            elif op == 0x30:  # POP
                if self.marks and len(self.stack) == self.marks[-1]:  # an empty frame: POP drops its MARK
                    self.pop_mark()
                else:
                    self.pop()
            elif op == 0x31:  # POP_MARK
                self.pop_mark()
            elif op == 0x32:  # DUP
                push(self.top())
            # -- scalars
            elif op == 0x4E:  # NONE
                push(None)
            elif op == 0x88:  # NEWTRUE
                push(True)
            elif op == 0x89:  # NEWFALSE
                push(False)
            elif op == 0x8A:  # LONG1
                push(int.from_bytes(self.take(self.uint(1)), "little", signed=True))
            elif op == 0x8B:  # LONG4
                n = self.uint(4)
                if n > MAX_INT_BYTES:
                    raise PickleRefused(f"it holds an integer of {n:,} bytes")
                push(int.from_bytes(self.take(n), "little", signed=True))
            elif op in (0x49, 0x4C):  # INT, LONG (text)
                text = self.line()
                if op == 0x49 and text in (b"00", b"01"):
                    push(text == b"01")
                    continue
                text = text.rstrip(b"L")
                if len(text) > 2 * MAX_INT_BYTES + 1:
                    raise PickleRefused(f"it holds an integer of {len(text):,} digits")
                try:
                    push(int(text))
                except ValueError:
                    raise PickleRefused("it is malformed (a bad integer)") from None
            elif op == 0x46:  # FLOAT (text)
                try:
                    push(float(self.line()))
                except ValueError:
                    raise PickleRefused("it is malformed (a bad float)") from None
            elif op == 0x47:  # BINFLOAT
                push(struct.unpack(">d", self.take(8))[0])
            elif op == 0x56:  # UNICODE (protocol 0)
                try:
                    push(codecs.decode(self.line(), "raw-unicode-escape"))
                except UnicodeDecodeError:
                    raise PickleRefused("it is malformed (a bad protocol-0 string)") from None
            elif op in (0x54, 0x55):  # BINSTRING, SHORT_BINSTRING (Python 2 str: read as Latin-1 text)
                push(self.take(self.uint(4 if op == 0x54 else 1)).decode("latin-1"))
            elif op == 0x53:  # STRING (protocol 0, a quoted Python 2 literal)
                text = self.line()
                if len(text) < 2 or text[:1] != text[-1:] or text[:1] not in (b"'", b'"'):
                    raise PickleRefused("it is malformed (a bad protocol-0 string)")
                try:
                    push(codecs.escape_decode(text[1:-1])[0].decode("latin-1"))
                except ValueError:
                    raise PickleRefused("it is malformed (a bad protocol-0 string)") from None
            elif op in (0x42, 0x43, 0x8E, 0x96):  # BINBYTES, SHORT_BINBYTES, BINBYTES8, BYTEARRAY8
                n = self.uint({0x42: 4, 0x43: 1, 0x8E: 8, 0x96: 8}[op])
                push(self.take(n))
            # -- containers
            elif op == 0x5D:  # EMPTY_LIST
                push(self.new([]))
            elif op == 0x7D:  # EMPTY_DICT
                push(self.new({}))
            elif op == 0x29:  # EMPTY_TUPLE
                self.count_container()
                push(())
            elif op == 0x8F:  # EMPTY_SET
                push(self.new(set()))
            elif op == 0x6C:  # LIST
                push(self.container("list", self.pop_mark()))
            elif op == 0x74:  # TUPLE
                push(self.container("tuple", self.pop_mark()))
            elif op in (0x85, 0x86, 0x87):  # TUPLE1, TUPLE2, TUPLE3
                items = [self.pop() for _ in range(op - 0x84)][::-1]
                push(self.container("tuple", items))
            elif op == 0x91:  # FROZENSET
                push(self.container("frozenset", self.pop_mark()))
            elif op == 0x64:  # DICT
                obj = self.new({})
                self.setitems(obj, self.pop_mark())
                push(obj)
            elif op == 0x61:  # APPEND
                item = self.pop()
                self.appends(self.top(), [item])
            elif op == 0x65:  # APPENDS
                items = self.pop_mark()
                self.appends(self.top(), items)
            elif op == 0x73:  # SETITEM
                value, key = self.pop(), self.pop()
                self.setitems(self.top(), [key, value])
            elif op == 0x75:  # SETITEMS
                items = self.pop_mark()
                self.setitems(self.top(), items)
            elif op == 0x90:  # ADDITEMS
                items = self.pop_mark()
                target = self.top()
                if not isinstance(target, set):
                    raise PickleRefused("it is malformed (ADDITEMS on something that is not a set)")
                self.grow(target, items)
                target.update(self.keys(items))
            # -- globals and object construction: never imported, never called
            elif op == 0x63:  # GLOBAL
                module = self.line().decode("utf-8", "replace")
                push(_Global(module, self.line().decode("utf-8", "replace")))
            elif op == 0x93:  # STACK_GLOBAL
                name, module = self.pop(), self.pop()
                if not isinstance(module, str) or not isinstance(name, str):
                    raise PickleRefused("it is malformed (STACK_GLOBAL of non-strings)")
                push(_Global(module, name))
            elif op in (0x52, 0x81):  # REDUCE, NEWOBJ
                args = self.pop()
                push(self.call(self.pop(), args))
            elif op == 0x92:  # NEWOBJ_EX
                _kwargs, args = self.pop(), self.pop()
                push(self.call(self.pop(), args))
            elif op == 0x62:  # BUILD
                state = self.pop()
                self.build(self.top(), state)
            elif op in (0x69, 0x6F):  # INST, OBJ: old-style instance creation, a call by another name
                raise PickleRefused("it creates Python objects (INST/OBJ opcodes), which could run code")
            elif op in (0x50, 0x51):  # PERSID, BINPERSID
                raise PickleRefused("it holds persistent ids (a torch.save file?), which a vocabulary never has")
            elif op in (0x82, 0x83, 0x84):  # EXT1, EXT2, EXT4
                raise PickleRefused("it refers to objects through the copyreg extension registry")
            elif op in (0x97, 0x98):  # NEXT_BUFFER, READONLY_BUFFER
                raise PickleRefused("it uses out-of-band buffers")
            else:
                raise PickleRefused(f"it is not a pickle stream (unknown opcode 0x{op:02x} at byte {self.pos - 1})")

    def _line_int(self) -> int:
        try:
            return int(self.line())
        except ValueError:
            raise PickleRefused("it is malformed (a bad memo key)") from None
