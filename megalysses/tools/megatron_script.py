"""Reading a Megatron-LM command line: the pretrain_gpt.py arguments a shell script passes, and arguments parsed
against the flag table of megalysses/config/megatron_names.py.

    argv = script_arguments(Path("train.sh").read_text(), ["ckpt/", "tb/"])   # the script's $1, $2, ...
    launcher, argv = script_launch(Path("train.sh").read_text(), ["ckpt/", "tb/"])   # and torchrun's own words
    given = parse_arguments(argv)       # {"--num-layers": 32, "--swiglu": True, "--data-path": ["a"], ...}
    given.unmapped                      # {"--wandb-entity": ["me"], ...}: Megatron-LM flags with no entry here

The script is read, not run, in the environment the converter runs in. Assignments (X=1, A=(...), A+=(...),
export), expansions ($X, ${X}, ${X:-default}, ${A[@]}, $1, "$@", $((arithmetic))), quotes, line continuations,
comments and if/elif/else blocks whose tests compare strings ([[ "$X" == y ]], [ -z "$X" ], ||, &&) are
followed as bash follows them; other commands are left out, and the first that runs pretrain_gpt.py (through
torchrun, python, srun, ...) gives the arguments. What cannot be followed (a loop that builds them, a command's
output) is an error naming the line, with the other way to give them:
`tools/from_megatron.py -- <pretrain_gpt.py arguments>`.
"""
from __future__ import annotations

import ast
import difflib
import operator
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

from megalysses.config.megatron_names import FLAGS
from megalysses.tools.megatron_flags import flag_group, megatron_flag_arity, megatron_flags

UNKNOWN = "\x00"          # marks text that came from a command's output, which is not run here
OTHER_WAY = "give the pretrain_gpt.py arguments after -- instead"


class MegatronArgsError(ValueError):
    """A command line or script that cannot be read; the message names the flag or the line."""


@dataclass
class _Tok:
    op: Optional[str]            # None for a word
    pieces: list[tuple[str, str]]  # (text, quote) with quote '', "'" or '"'
    line: int


def _read_dollar(text: str, i: int) -> int:
    """The end of the $-expression starting at text[i] == '$'."""
    if text.startswith("$((", i) or text.startswith("$(", i) or text.startswith("${", i):
        opening, closing = ("(", ")") if text[i + 1] == "(" else ("{", "}")
        depth, j = 0, i + 1
        while j < len(text):
            depth += {opening: 1, closing: -1}.get(text[j], 0)
            j += 1
            if depth == 0:
                return j
        raise MegatronArgsError(f"line {text.count(chr(10), 0, i) + 1}: an unclosed {text[i:i + 2]}")
    m = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*|[0-9@*#?$!-])").match(text, i)
    return m.end() if m else i + 1


def _lex(text: str) -> list[_Tok]:
    toks: list[_Tok] = []
    pieces: list[tuple[str, str]] = []
    line, i = 1, 0

    def end_word() -> None:
        if pieces:
            toks.append(_Tok(None, list(pieces), line))
            pieces.clear()

    def bare(text: str) -> None:            # unquoted text (expanded later) joins the unquoted text before it
        if pieces and pieces[-1][1] == "":
            pieces[-1] = (pieces[-1][0] + text, "")
        else:
            pieces.append((text, ""))

    while i < len(text):
        ch = text[i]
        if ch == "\\" and text.startswith("\\\n", i):
            i, line = i + 2, line + 1
        elif ch == "\\":
            pieces.append((text[i + 1:i + 2], "'"))
            i += 2
        elif ch in " \t\r":
            end_word()
            i += 1
        elif ch == "#" and not pieces:
            while i < len(text) and text[i] != "\n":
                i += 1
        elif ch == "'":
            j = text.find("'", i + 1)
            if j < 0:
                raise MegatronArgsError(f"line {line}: an unclosed ' quote")
            pieces.append((text[i + 1:j], "'"))
            line, i = line + text.count("\n", i, j), j + 1
        elif ch == '"':
            j, buf = i + 1, ""
            while j < len(text) and text[j] != '"':
                if text[j] == "\\" and j + 1 < len(text) and text[j + 1] in '"\\$`\n':
                    buf += "" if text[j + 1] == "\n" else "\\" + text[j + 1] if text[j + 1] == "$" else text[j + 1]
                    j += 2
                elif text[j] == "$":
                    k = _read_dollar(text, j)
                    buf, j = buf + text[j:k], k
                else:
                    buf, j = buf + text[j], j + 1
            if j >= len(text):
                raise MegatronArgsError(f"line {line}: an unclosed \" quote")
            pieces.append((buf, '"'))
            line, i = line + text.count("\n", i, j), j + 1
        elif ch == "$":
            k = _read_dollar(text, i)
            bare(text[i:k])
            line, i = line + text.count("\n", i, k), k
        elif ch in "\n;&|()":
            end_word()
            op = text[i:i + 2] if text[i:i + 2] in ("&&", "||", ";;") else ch
            toks.append(_Tok(op, [], line))
            line, i = line + (ch == "\n"), i + len(op)
        else:
            bare(ch)
            i += 1
    end_word()
    return toks


class _Shell:
    def __init__(self, args: list[str]) -> None:
        # the environment, as the script would see it where the converter runs, and its $1, $2, ...
        self.scalars: dict[str, str] = {**os.environ, **{str(k): v for k, v in enumerate(args, 1)}}
        self.arrays: dict[str, list[str]] = {}

    # -- expansion
    def _param(self, expr: str, line: int) -> list[str]:
        """The values of one ${...} / $name expression (several for ${A[@]})."""
        m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*|[0-9]+)(?:\[([@*]|[0-9]+)\])?(?:(:?[-=+])(.*))?", expr, re.S)
        if not m:
            if expr in ("@", "*", "#"):
                args = [self.scalars[k] for k in sorted((k for k in self.scalars if k.isdigit()), key=int)]
                return [str(len(args))] if expr == "#" else args
            raise MegatronArgsError(f"line {line}: the expansion ${{{expr}}} is not one this reader follows; "
                                    f"{OTHER_WAY}")
        name, index, op, word = m.groups()
        if index in ("@", "*"):
            values = self.arrays.get(name, [self.scalars[name]] if name in self.scalars else [])
        elif index is not None:
            arr = self.arrays.get(name, [self.scalars.get(name, "")])
            values = [arr[int(index)]] if int(index) < len(arr) else []
        else:
            values = [self.arrays[name][0]] if self.arrays.get(name) else (
                [self.scalars[name]] if name in self.scalars else [])
        is_set = bool(values) and (op is None or not op.startswith(":") or any(values))
        if op is not None and op.endswith(("-", "=")) and not is_set:
            values = [" ".join(self.expand_text(word, line))]
            if op.endswith("="):
                self.scalars[name] = values[0]
        elif op is not None and op.endswith("+"):
            values = [" ".join(self.expand_text(word, line))] if is_set else []
        return values

    def expand_text(self, text: str, line: int) -> list[str]:
        """Expansions inside text as one string per ${A[@]} element (quote removal of the default words)."""
        parts, i = [""], 0
        while i < len(text):
            if text[i] == "$":
                k = _read_dollar(text, i)
                values = self._dollar(text[i:k], line)
                parts[-1] += values[0] if values else ""
                parts.extend(values[1:])
                i = k
            elif text[i] in "'\"":
                parts[-1] += text[i]          # quotes inside a ${X:-"default"} word are removed below
                i += 1
            else:
                parts[-1] += text[i]
                i += 1
        return [p.replace('"', "").replace("'", "") if '"' in p or "'" in p else p for p in parts]

    def _dollar(self, expr: str, line: int) -> list[str]:
        if expr.startswith("$(("):
            inner = " ".join(self.expand_text(expr[3:-2], line))
            return [str(_arithmetic(inner, self.scalars, line))] if UNKNOWN not in inner else [UNKNOWN + expr]
        if expr.startswith("$("):
            return [UNKNOWN + expr]
        if expr.startswith("${"):
            return self._param(expr[2:-1], line)
        if expr == "$":
            return ["$"]
        return self._param(expr[1:], line)

    def words(self, tok: _Tok, split: bool = True) -> list[str]:
        """A word's fields after expansion, word splitting of unquoted expansions and quote removal ("$X" with X
        empty is one empty field, $X none); split=False (an assignment's value): no word splitting."""
        fields: list[list] = [["", False]]         # [text, holds something quoted]
        for text, quote in tok.pieces:
            if quote == "'":
                fields[-1][0] += text
                fields[-1][1] = True
                continue
            fields[-1][1] |= quote == '"'
            i = 0
            while i < len(text):
                if text[i] != "$":
                    escaped = text.startswith("\\$", i)
                    fields[-1][0] += "$" if escaped else text[i]
                    i += 2 if escaped else 1
                    continue
                k = _read_dollar(text, i)
                values = self._dollar(text[i:k], tok.line)
                if quote == '"' or not split:
                    fields[-1][0] += " ".join(values) if not split else values[0] if values else ""
                    fields.extend([v, True] for v in (values[1:] if split else []))
                else:
                    _split_onto(fields, values)
                i = k
        return [text for text, quoted in fields if text or quoted]


def _split_onto(fields: list[list], values: list[str]) -> None:
    """An unquoted expansion's values added to the fields ([text, holds something quoted]) with word splitting:
    each value's words at whitespace, a new field where a value after the first, or one starting with
    whitespace, begins, and where one ending with whitespace ends."""
    for n, v in enumerate(values):
        words = v.split()
        if (n or v[:1].isspace()) and fields[-1][0] and words:
            fields.append(["", False])
        if words:
            fields[-1][0] += words[0]
            fields.extend([w, False] for w in words[1:])
        if v[-1:].isspace() and fields[-1][0]:
            fields.append(["", False])


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod, ast.Pow: operator.pow}


def _arithmetic(expr: str, scalars: dict[str, str], line: int) -> int:
    """bash's $(( )) on integers: + - * / % ** and parentheses, variable names read as numbers."""
    expr = re.sub(r"\$?\b([A-Za-z_][A-Za-z0-9_]*)\b", lambda m: scalars.get(m.group(1), "0") or "0", expr)

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError
    try:
        return value(ast.parse(expr.strip().replace("/", "//").replace("****", "**"), mode="eval").body)
    except (ValueError, SyntaxError, ZeroDivisionError):
        raise MegatronArgsError(f"line {line}: the arithmetic $(({expr})) is not one this reader follows; "
                                f"{OTHER_WAY}") from None


def _commands(toks: list[_Tok]) -> list[tuple[str, list[_Tok]]]:
    """(separator before it, simple command): split at newlines, ;, &&, || and |; an array assignment's ( ... )
    stays in one command."""
    out: list[tuple[str, list[_Tok]]] = [("\n", [])]
    depth, sep = 0, "\n"
    for t in toks:
        depth += {"(": 1, ")": -1}.get(t.op or "", 0)
        if t.op in ("\n", ";", "&&", "||", "|", "&", ";;") and depth == 0:
            sep = t.op if t.op in ("&&", "||") else "\n"
            out.append((sep, []))
        elif t.op != "\n":
            out[-1][1].append(t)
    return [(s, c) for s, c in out if c]


_ASSIGN = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(\+?)=")
_BLOCKS = {"for": "done", "while": "done", "until": "done", "case": "esac"}
_LAUNCHERS = ("pretrain_gpt.py",)


def _plain(tok: _Tok) -> str:
    return "".join(t for t, _ in tok.pieces) if tok.op is None else tok.op


def script_arguments(text: str, args: Optional[list[str]] = None) -> list[str]:
    """The arguments the script passes to pretrain_gpt.py (its $1, $2, ... are `args`)."""
    return script_launch(text, args)[1]


def script_launch(text: str, args: Optional[list[str]] = None) -> tuple[list[str], list[str]]:
    """(the words before pretrain_gpt.py on the command that runs it: the launcher and its options; the
    arguments the script passes to pretrain_gpt.py); its $1, $2, ... are `args`."""
    shell, cmds = _Shell(list(args or [])), _commands(_lex(text))
    found = _run(shell, cmds, 0, len(cmds))
    if found is None:
        raise MegatronArgsError("the script never runs pretrain_gpt.py: give a script that launches it (torchrun "
                                "... pretrain_gpt.py ...), or the arguments after --")
    launcher, found = found
    return launcher, [a.strip("'\"") if len(a) > 1 and a[0] == a[-1] and a[0] in "'\"" else a for a in found]


def launch_world(launcher: list[str]) -> tuple[Optional[int], Optional[int]]:
    """(processes per node, nodes) that torchrun's options among `launcher` give (--nproc-per-node,
    --nnodes, the elastic MIN:MAX taken at its MAX); None where they are not given as numbers."""
    found: dict[str, Optional[int]] = {"nproc": None, "nnodes": None}
    for i, word in enumerate(launcher):
        name, _, value = word.partition("=")
        key = {"--nproc_per_node": "nproc", "--nproc-per-node": "nproc", "--nnodes": "nnodes"}.get(name)
        if key is None:
            continue
        value = value or (launcher[i + 1] if i + 1 < len(launcher) else "")
        value = value.rsplit(":", 1)[-1]
        found[key] = int(value) if value.isdigit() and int(value) > 0 else None
    return found["nproc"], found["nnodes"]


def _run(shell: _Shell, cmds: list, start: int, end: int) -> Optional[tuple[list[str], list[str]]]:
    i = start
    while i < end:
        cmd = cmds[i][1]
        head = _plain(cmd[0])
        if head == "if":
            found, i = _run_if(shell, cmds, i, end)
        elif head in _BLOCKS or head == "function" or (len(cmd) > 1 and cmd[1].op == "(" and cmd[0].op is None
                                                       and not _ASSIGN.match(head)):
            found, i = _skip_block(cmds, i, end)
        else:
            found, i = _simple(shell, cmd), i + 1
        if found is not None:
            return found
    return None


def _simple(shell: _Shell, cmd: list[_Tok]) -> Optional[tuple[list[str], list[str]]]:
    """Follow an assignment (or export of one); for any other command, return its words before pretrain_gpt.py and
    its arguments after it, when it runs it."""
    words = cmd[1:] if _plain(cmd[0]) in ("export", "declare", "local", "readonly", "typeset") else cmd
    words = [t for t in words if not (t.op is None and _plain(t).startswith("-") and words is not cmd)]
    assigned = False
    while words and words[0].op is None and _ASSIGN.match(_plain(words[0])) and not words[0].pieces[0][1]:
        first = words[0]
        m = _ASSIGN.match(first.pieces[0][0])
        name, append = m.group(1), bool(m.group(2))
        rest = _Tok(None, [(first.pieces[0][0][m.end():], "")] + first.pieces[1:], first.line)
        if len(words) > 1 and words[1].op == "(" and not _plain(rest):
            close = next(k for k, t in enumerate(words) if t.op == ")")
            values = [v for t in words[2:close] for v in shell.words(t)]
            shell.arrays[name] = (shell.arrays.get(name, []) if append else []) + values
            words = words[close + 1:]
        else:
            value = "".join(shell.words(rest, split=False) if rest.pieces != [("", "")] else [])
            if name in shell.arrays and not append:
                shell.arrays[name][:1] = [value]
            else:
                shell.scalars[name] = (shell.scalars.get(name, "") if append else "") + value
            words = words[1:]
        assigned = True
    if not words or assigned:                 # X=1 cmd: X is the command's alone; nothing else to follow
        return None
    argv = [w for t in words if t.op is None for w in shell.words(t)]
    for n, word in enumerate(argv):
        if word.rsplit("/", 1)[-1] in _LAUNCHERS:
            args = argv[n + 1:]
            unknown = [a for a in args if UNKNOWN in a]
            if unknown:
                raise MegatronArgsError(f"line {cmd[0].line}: the argument {unknown[0].replace(UNKNOWN, '')} is a "
                                        f"command's output, which is not run here; {OTHER_WAY}")
            return argv[:n], args
    return None


def _block_end(cmds: list, i: int, end: int, opening: str, closing: str) -> int:
    depth = 0
    for j in range(i, end):
        words = [_plain(t) for t in cmds[j][1]]
        depth += words.count(opening) - words.count(closing)
        if depth <= 0 and closing in words:
            return j
    raise MegatronArgsError(f"line {cmds[i][1][0].line}: '{opening}' without its '{closing}'")


def _skip_block(cmds: list, i: int, end: int) -> tuple[None, int]:
    head = _plain(cmds[i][1][0])
    closing = _BLOCKS.get(head, "}")
    stop = _block_end(cmds, i, end, head if head in _BLOCKS else "{", closing)
    body = [t for _, c in cmds[i:stop + 1] for t in c]
    if any(_plain(t).endswith(_LAUNCHERS) or _ASSIGN.match(_plain(t)) for t in body):
        raise MegatronArgsError(f"line {cmds[i][1][0].line}: a '{head}' block that sets variables or runs "
                                f"pretrain_gpt.py is not followed; {OTHER_WAY}")
    return None, stop + 1


def _run_if(shell: _Shell, cmds: list, i: int, end: int) -> tuple[Optional[tuple[list[str], list[str]]], int]:
    """if/elif/else/fi: the first branch whose test holds runs."""
    fi = _block_end(cmds, i, end, "if", "fi")
    branches: list[list] = []          # [test commands or None for else, body start, body end]
    depth, test_start = 0, i
    for j in range(i, fi + 1):
        head = _plain(cmds[j][1][0])
        depth += head == "if"
        if depth == 1 and head in ("then", "elif", "else", "fi"):
            if branches and branches[-1][2] is None and head != "then":
                branches[-1][2] = j
            if head == "then":
                branches.append([cmds[test_start:j], j, None])
            elif head == "else":
                branches.append([None, j, None])
            test_start = j
            cmds[j] = (cmds[j][0], cmds[j][1][1:] or [_Tok(None, [(":", "")], cmds[j][1][0].line)])
        depth -= head == "fi"
    bodies = [t for _, start, stop in branches for _, c in cmds[start:stop] for t in c]
    if not any(_plain(t).endswith(_LAUNCHERS) or _ASSIGN.match(_plain(t)) for t in bodies):
        return None, fi + 1              # nothing in it changes the arguments (an echo, an exit): not tested
    for test, body_start, body_end in branches:
        if test is None or _test(shell, test):
            return _run(shell, cmds, body_start, body_end), fi + 1
    return None, fi + 1


def _test(shell: _Shell, test: list) -> bool:
    """An if/elif test: [[ ]], [ ] or test commands joined by && and || (left to right, as bash runs a list)."""
    result: Optional[bool] = None
    line = test[0][1][0].line
    for n, (sep, cmd) in enumerate(test):
        toks = cmd[1:] if n == 0 else cmd            # the if / elif keyword
        words = [w for t in toks for w in (shell.words(t) if t.op is None else [t.op])]
        value = _primary(words, line)
        result = value if result is None else (result and value) if sep == "&&" else (result or value)
    return bool(result)


_COMPARE = {"==": operator.eq, "=": operator.eq, "!=": operator.ne}
_NUMERIC = {"-eq": operator.eq, "-ne": operator.ne, "-lt": operator.lt, "-gt": operator.gt, "-le": operator.le,
            "-ge": operator.ge}


def _primary(words: list[str], line: int) -> bool:
    if words[:1] in (["[["], ["["]):
        words = words[1:-1] if words[-1:] in (["]]"], ["]"]) else words[1:]
    elif words[:1] == ["test"]:
        words = words[1:]
    if words[:1] == ["!"]:
        return not _primary(words[1:], line)
    if any(UNKNOWN in w for w in words):
        raise MegatronArgsError(f"line {line}: a test on a command's output is not followed; {OTHER_WAY}")
    if len(words) == 3 and words[1] in _COMPARE:
        return _COMPARE[words[1]](words[0], words[2])
    if len(words) == 3 and words[1] in _NUMERIC and all(re.fullmatch(r"-?[0-9]+", w) for w in words[::2]):
        return _NUMERIC[words[1]](int(words[0]), int(words[2]))
    if len(words) == 2 and words[0] in ("-z", "-n"):
        return (words[1] == "") == (words[0] == "-z")
    if len(words) == 1:
        return words[0] != ""
    raise MegatronArgsError(f"line {line}: the test '{' '.join(words)}' is not one this reader follows; {OTHER_WAY}")


# ----------------------------------------------------------------------------- the arguments

def _value(flag: str, kind: str, raw: str) -> Any:
    try:
        return int(raw) if kind in ("int", "ints", "int3") else float(raw) if kind == "float" else raw
    except ValueError:
        what = "an integer" if kind != "float" else "a number"
        raise MegatronArgsError(f"{flag}: expected {what}, got {raw!r}") from None


class Given(dict):
    """parse_arguments' result: {flag: value} for the flags megalysses' table maps (megatron_names.FLAGS), and in
    `unmapped` {flag: its words} for the Megatron-LM flags it has no entry for."""

    def __init__(self) -> None:
        super().__init__()
        self.unmapped: dict[str, list[str]] = {}


def parse_arguments(argv: list[str]) -> Given:
    """pretrain_gpt.py's arguments as {flag: value} for the flags given, parsed as Megatron-LM's argparse parses
    them (the last of a repeated flag wins); a Megatron-LM flag without an entry in the table lands in
    `.unmapped` with its words. One MegatronArgsError names every flag Megatron-LM does not have (with the
    real flag it most resembles, where one does closely) and refuses a mixture-of-experts command line as such;
    a missing value, a value of the wrong type or one outside the flag's choices is one naming the flag."""
    given, not_megatron, experts = Given(), [], []
    i = 0
    while i < len(argv):
        word = argv[i]
        name, _, inline = word.partition("=") if word.startswith("--") else (word, "", "")
        flag = FLAGS.get(name)
        if not word.startswith("--"):
            after = f" (after {argv[i - 1]})" if i else ""
            raise MegatronArgsError(f"unexpected argument {word!r}{after}: pretrain_gpt.py takes --flag value pairs")
        if flag is None:
            i, values = _skip_values(argv, i, megatron_flag_arity(name), inline)
            if megatron_flag_arity(name) is None:
                not_megatron.append(name)
            else:
                given.unmapped[name] = values
                if name == "--num-experts" and values and values[-1] not in ("0", "None"):
                    experts.append(f"{name} {values[-1]}")
            continue
        values = [inline] if inline else []
        j = i + 1
        if not inline and flag.kind not in ("flag", "noflag"):
            while j < len(argv) and not (argv[j].startswith("--") and len(argv[j]) > 2):
                values.append(argv[j])
                j += 1
        if flag.kind in ("flag", "noflag"):
            if inline:
                raise MegatronArgsError(f"{name} takes no value, got {inline!r}")
            given[name] = flag.kind == "flag"
        elif flag.kind in ("int", "float", "str"):
            if len(values) != 1:
                hint = " (a quoted value split by an unquoted ${ARRAY[@]}? quote the expansion)" if values else ""
                raise MegatronArgsError(f"{name} needs one value, got {len(values)}: {' '.join(values) or 'none'}"
                                        f"{hint}")
            given[name] = _value(name, flag.kind, values[0])
        elif flag.kind == "int3":
            if len(values) != 3:
                raise MegatronArgsError(f"{name} needs three integers (start, increment, samples), got "
                                        f"{' '.join(values) or 'none'}")
            given[name] = [_value(name, "int", v) for v in values]
        else:                                     # ints, strs (one or more), paths (any number)
            if not values and flag.kind != "paths":
                raise MegatronArgsError(f"{name} needs at least one value")
            given[name] = [_value(name, flag.kind, v) for v in values]
        for v in given[name] if isinstance(given[name], list) else [given[name]]:
            if flag.choices and isinstance(v, str) and v not in flag.choices:
                raise MegatronArgsError(f"{name}: {v!r} is not one of {', '.join(flag.choices)}")
        i = j if not inline and flag.kind not in ("flag", "noflag") else i + 1
    if experts or not_megatron:
        raise MegatronArgsError(_refusal(experts, not_megatron, given))
    return given


def _skip_values(argv: list[str], i: int, arity: Optional[str], inline: str) -> tuple[int, list[str]]:
    """(the index after flag argv[i] and its values, the values) for a flag read by its Megatron-LM arity (None:
    not a Megatron-LM flag, whose values are taken to be the words up to the next flag)."""
    if inline or arity == "switch":
        return i + 1, [inline] if inline else []
    if arity == "value":
        return min(i + 2, len(argv)), argv[i + 1:i + 2]
    j = i + 1
    while j < len(argv) and not (argv[j].startswith("--") and len(argv[j]) > 2):
        j += 1
    return j, argv[i + 1:j]


def _refusal(experts: list[str], not_megatron: list[str], given: Given) -> str:
    """One line: a mixture-of-experts command line refused as such, and every flag Megatron-LM does not have."""
    parts = []
    if experts:
        moe = experts + [f for f in given.unmapped if flag_group(f) == "moe" and f != "--num-experts"]
        parts.append(f"this is a mixture-of-experts command line ({', '.join(moe)}): megalysses trains dense models, "
                     f"so it is not converted")
    if not_megatron:
        known = sorted(set(FLAGS) | set(megatron_flags()))
        named = []
        for flag in not_megatron:       # a close spelling, or the one real flag it is the end of (--yarn-beta-fast)
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.85) or [
                f for f in known if f.endswith("-" + flag[2:])]
            named.append(flag + (f" (did you mean {close[0]}?)" if len(close) == 1 else ""))
        parts.append(f"{len(named)} flag{'s' * (len(named) > 1)} that Megatron-LM's pretrain_gpt.py does not have: "
                     f"{', '.join(named)}: remove {'them' if len(named) > 1 else 'it'}, or convert without "
                     f"{'them' if len(named) > 1 else 'it'} and set the config keys by hand")
    return "; ".join(parts)
