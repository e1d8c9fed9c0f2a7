"""A static check of a pickle's opcodes before anything unpickles it: shape, depth and cost, never code.

``scan`` walks the opcode stream (``pickletools.genops``) on abstract values, building no object,
and refuses what a restricted ``find_class`` alone lets through:

- nesting deeper than ``Policy.max_depth`` (a 1 MB pickle of nested tuples overflows the C stack
  when the result is hashed or compared: a segfault, not an exception);
- a pickle whose objects, counted as trees (a shared object counts at every place it is used), or
  whose calls' arguments, add up to more than ``Policy.weight_per_byte`` units per byte of the pickle
  (a list memoized once and passed to ``frozenset`` 10,000 times is 1.5 GiB from 100 KB);
- ``BUILD`` on anything but an instance that ``NEWOBJ`` (or, where the policy allows, a call)
  created and that was not built or placed anywhere yet: never on a class, so no crafted state
  can set a class attribute for the whole process;
- a container changed after it was placed inside another one (the only way to build a cycle or
  deepen an object behind the depth count's back);
- the opcodes no file of ours uses (``INST``, ``OBJ``, extension codes, out-of-band buffers,
  ``NEWOBJ_EX``; persistent ids unless the policy allows them).

Globals are only named here; the caller's unpickler decides which exist (its ``find_class``). The
policy's ``check_build`` sees the class and the state's shape of each ``BUILD``.
"""

from __future__ import annotations

import pickletools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Scalar opcodes -> kind of the value they push.
_SCALARS: dict[str, str] = {
    **{n: "int" for n in ("INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4")},
    **{n: "bytes" for n in ("STRING", "BINSTRING", "SHORT_BINSTRING", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8")},
    **{n: "str" for n in ("UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8")},
    "NONE": "none", "NEWTRUE": "bool", "NEWFALSE": "bool", "FLOAT": "float", "BINFLOAT": "float",
}
_EMPTY: dict[str, str] = {"EMPTY_LIST": "list", "EMPTY_DICT": "dict", "EMPTY_SET": "set", "EMPTY_TUPLE": "tuple"}
_FROM_MARK: dict[str, str] = {"LIST": "list", "TUPLE": "tuple", "DICT": "dict", "FROZENSET": "frozenset"}
_TUPLE_N = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}
_MUTATORS: dict[str, str] = {"APPEND": "list", "APPENDS": "list", "SETITEM": "dict", "SETITEMS": "dict", "ADDITEMS": "set"}
_PUT = ("PUT", "BINPUT", "LONG_BINPUT")
_GET = ("GET", "BINGET", "LONG_BINGET")
_NEVER = ("INST", "OBJ", "EXT1", "EXT2", "EXT4", "NEXT_BUFFER", "READONLY_BUFFER", "NEWOBJ_EX")


class PickleRefused(Exception):
    """The pickle breaks ``Policy``; the message says how (the caller names the file)."""


class Value:
    """An abstract value on the stack or in the memo: what it is, how deep and how large as a tree."""

    __slots__ = ("kind", "depth", "weight", "text", "name", "keys", "placed", "built")

    def __init__(self, kind: str, depth: int = 0, weight: int = 1, text: str | None = None,
                 name: tuple[str, str] | None = None, keys: list[Value] | None = None) -> None:
        self.kind = kind  # int, str, bytes, list, dict, tuple, set, frozenset, global, instance, called, pid, ...
        self.depth = depth
        self.weight = weight
        self.text = text  # a str's value (for globals and BUILD state keys)
        self.name = name  # a global's (module, name); an instance's class or a call result's callable
        self.keys: list[Value] = keys if keys is not None else []  # a dict's keys; a tuple's items
        self.placed = False  # inside another object (or a call's argument): no longer changeable
        self.built = False


# Scalars other than strings are immutable and weigh 1: one shared abstract value each (most opcodes push one).
_SHARED_SCALARS = {kind: Value(kind) for kind in ("int", "none", "bool", "float")}


@dataclass(frozen=True)
class Policy:
    """What one kind of pickle may hold.

    ``check_build(name, state)`` returns a problem or None for ``BUILD`` of an instance of class ``name``
    (the abstract ``state``); ``build_on_calls`` also allows ``BUILD`` on what a ``REDUCE`` returned
    (torch's own unpickler then decides); ``persistent_ids`` allows ``BINPERSID`` (tensor storages).
    """

    max_depth: int
    weight_per_byte: int = 8
    weight_floor: int = 4096
    check_build: Callable[[tuple[str, str], Value], str | None] | None = None
    build_on_calls: bool = False
    persistent_ids: bool = False
    mutable_calls: bool = False  # APPENDS/SETITEMS on a call's or NEWOBJ's result (an OrderedDict of torch.save)


def _scalar_weight(kind: str, arg: Any) -> int:
    if isinstance(arg, (str, bytes, bytearray)):
        return 1 + len(arg) // 8
    if isinstance(arg, int):
        return 1 + arg.bit_length() // 64
    return 1


def scan(data: bytes, policy: Policy) -> None:
    """Raise ``PickleRefused`` unless ``data`` is one pickle within ``policy``; builds nothing."""
    _Scan(data, policy).run()


class _Scan:
    def __init__(self, data: bytes, policy: Policy) -> None:
        self.data = data
        self.policy = policy
        self.limit = policy.weight_floor + policy.weight_per_byte * len(data)
        self.spent = 0  # units of everything created or passed to a call so far
        self.stack: list[Value] = []
        self.marks: list[list[Value]] = []
        self.memo: dict[int, Value] = {}

    # ------------------------------------------------------------ helpers
    def _charge(self, weight: int, what: str) -> None:
        self.spent += weight
        if weight > self.limit or self.spent > self.limit:
            raise PickleRefused(
                f"{what} makes the pickle cost more than {self.limit} units for its {len(self.data)} bytes "
                "(objects reused or copied many times: an amplification)"
            )

    def _pop(self, n: int = 1) -> list[Value]:
        if len(self.stack) < n:
            raise PickleRefused("an opcode takes more values than the stack holds")
        items = self.stack[len(self.stack) - n :]
        del self.stack[len(self.stack) - n :]
        return items

    def _pop_mark(self) -> list[Value]:
        if not self.marks:
            raise PickleRefused("an opcode needs a MARK that is not there")
        items = self.stack
        self.stack = self.marks.pop()
        return items

    def _top(self) -> Value:
        if not self.stack:
            raise PickleRefused("an opcode needs a value on an empty stack")
        return self.stack[-1]

    def _place(self, items: list[Value]) -> None:
        for item in items:
            item.placed = True

    def _new(self, kind: str, items: list[Value], **extra: Any) -> Value:
        self._place(items)
        depth = 1 + max((i.depth for i in items), default=0)
        if depth > self.policy.max_depth:
            raise PickleRefused(f"objects nest deeper than {self.policy.max_depth} levels")
        value = Value(kind, depth=depth, weight=1 + sum(i.weight for i in items), **extra)
        self._charge(value.weight, f"a {kind} of {len(items)} items")
        return value

    def _grow(self, target: Value, items: list[Value], kind: str) -> None:
        # An OrderedDict (or a dict subclass an allow-list admits) is a call's or NEWOBJ's result filled by SETITEMS.
        allowed = target.kind == kind or (self.policy.mutable_calls and target.kind in ("called", "instance"))
        if not allowed:
            raise PickleRefused(f"items are added to a {target.kind}, not a {kind}")
        if target.placed or any(i is target for i in items):
            raise PickleRefused(f"a {target.kind} is changed after it was placed in another object (a cycle or a hidden nesting)")
        self._place(items)
        target.depth = max(target.depth, 1 + max((i.depth for i in items), default=0))
        if target.depth > self.policy.max_depth:
            raise PickleRefused(f"objects nest deeper than {self.policy.max_depth} levels")
        added = sum(i.weight for i in items)
        target.weight += added
        if kind == "dict":
            target.keys.extend(items[0::2])
        self._charge(added, f"adding {len(items)} items to a {target.kind}")

    # ------------------------------------------------------------ the walk
    def run(self) -> None:
        try:
            ops = pickletools.genops(self.data)
            for opcode, arg, _pos in ops:
                if self._step(opcode.name, arg):
                    return
        except PickleRefused:
            raise
        except Exception as error:  # noqa: BLE001 - genops on cut or overwritten bytes
            raise PickleRefused(f"the pickle is malformed ({type(error).__name__}: {error})") from error
        raise PickleRefused("the pickle has no STOP opcode")

    def _step(self, name: str, arg: Any) -> bool:  # noqa: C901 - one branch per opcode family
        if name in _PUT:  # the most frequent opcodes first
            if not isinstance(arg, int) or arg < 0:
                raise PickleRefused(f"a memo index {arg!r}")
            self.memo[arg] = self._top()
        elif name in _GET:
            if arg not in self.memo:
                raise PickleRefused(f"a memo reference {arg!r} to nothing")
            self.stack.append(self.memo[arg])
        elif name in _SCALARS:
            kind = _SCALARS[name]
            if kind in _SHARED_SCALARS and (kind != "int" or -(1 << 63) <= arg < (1 << 63)):
                value = _SHARED_SCALARS[kind]
                self.spent += 1
            else:
                value = Value(kind, weight=_scalar_weight(kind, arg), text=arg if kind == "str" else None)
                self._charge(value.weight, "a value")
            self.stack.append(value)
        elif name in _EMPTY:
            self.stack.append(self._new(_EMPTY[name], []))
        elif name in _FROM_MARK:
            items = self._pop_mark()
            if name == "DICT" and len(items) % 2:
                raise PickleRefused("DICT has an odd number of items")
            value = self._new(_FROM_MARK[name], items)
            value.keys = items[0::2] if name == "DICT" else list(items)
            self.stack.append(value)
        elif name in _TUPLE_N:
            items = self._pop(_TUPLE_N[name])
            self.stack.append(self._new("tuple", items, keys=list(items)))
        elif name in _MUTATORS:
            if name in ("APPEND", "SETITEM"):
                items = self._pop(1 if name == "APPEND" else 2)
            else:
                items = self._pop_mark()
            if name == "SETITEMS" and len(items) % 2:
                raise PickleRefused("SETITEMS has an odd number of items")
            self._grow(self._top(), items, _MUTATORS[name])
        elif name == "MARK":
            if len(self.marks) >= self.policy.max_depth:
                raise PickleRefused(f"MARKs nest deeper than {self.policy.max_depth} levels")
            self.marks.append(self.stack)
            self.stack = []
        elif name == "POP":
            if self.stack:
                self.stack.pop()
            else:
                self._pop_mark()
        elif name == "POP_MARK":
            self._pop_mark()
        elif name == "DUP":
            self.stack.append(self._top())
        elif name == "MEMOIZE":
            self.memo[len(self.memo)] = self._top()
        elif name in ("GLOBAL", "STACK_GLOBAL"):
            self.stack.append(Value("global", name=self._global_name(name, arg)))
        elif name == "REDUCE":
            func, args = self._pop(2)
            if func.kind != "global":
                raise PickleRefused(f"REDUCE calls a {func.kind}, not a global")
            self.stack.append(self._new("called", [args], name=func.name))
        elif name == "NEWOBJ":
            cls, args = self._pop(2)
            if cls.kind != "global":
                raise PickleRefused(f"NEWOBJ instantiates a {cls.kind}, not a class")
            self.stack.append(self._new("instance", [args], name=cls.name))
        elif name == "BUILD":
            (state,) = self._pop(1)
            self._build(self._top(), state)
        elif name == "BINPERSID" and self.policy.persistent_ids:
            (pid,) = self._pop(1)
            self.stack.append(self._new("pid", [pid]))
        elif name in ("PROTO", "FRAME"):
            pass
        elif name == "STOP":
            if len(self.stack) != 1 or self.marks:
                raise PickleRefused("the pickle does not end with exactly one object")
            return True
        else:
            raise PickleRefused(f"the opcode {name}, which no checkpoint file of ours holds")
        return False

    def _global_name(self, opcode: str, arg: Any) -> tuple[str, str]:
        if opcode == "GLOBAL":
            module, _, attr = str(arg).partition(" ")
            return module, attr
        module, attr = self._pop(2)
        if module.text is None or attr.text is None:
            raise PickleRefused("STACK_GLOBAL names a global with values that are not plain strings")
        return module.text, attr.text

    def _build(self, target: Value, state: Value) -> None:
        if target.kind == "global":
            raise PickleRefused(f"BUILD on the class {'.'.join(target.name or ())} would set attributes of the class itself")
        if target.kind not in ("instance", "called") or (target.kind == "called" and not self.policy.build_on_calls):
            raise PickleRefused(f"BUILD on a {target.kind}, not an instance of an allowed class")
        if target.built or target.placed:
            raise PickleRefused("BUILD on an instance that was built already or placed elsewhere")
        if self.policy.check_build is not None:
            assert target.name is not None
            problem = self.policy.check_build(target.name, state)
            if problem:
                raise PickleRefused(problem)
        target.built = True
        self._grow_by_state(target, state)

    def _grow_by_state(self, target: Value, state: Value) -> None:
        state.placed = True
        target.depth = max(target.depth, 1 + state.depth)
        if target.depth > self.policy.max_depth:
            raise PickleRefused(f"objects nest deeper than {self.policy.max_depth} levels")
        target.weight += state.weight
        self._charge(state.weight, "an instance's state")
