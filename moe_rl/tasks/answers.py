"""Rule-based answer checking for math-style tasks.

``extract_answer(text)``: the content of the last ``\\boxed{...}`` (braces balanced, also
``\\fbox``), else the last number in the text (``-3``, ``1,234``, ``0.5``, ``.5``), else None.

``reference_answer(raw)``: the ground truth from a dataset's answer field. A GSM8K-style
worked solution (``... #### 42``) gives what follows the last ``####``; a MATH-style solution
with a ``\\boxed{}`` gives the boxed content; anything else is used as it is.

``answers_match(pred, ref)``: both are normalised (whitespace stripped, ``$`` and a
``\\text{}`` wrapper removed, thousands separators ``1,234`` dropped, a trailing ``.``
removed); when both then parse as numbers (integers, decimals, ``a/b``, ``\\frac{a}{b}``)
they are compared numerically with a relative tolerance of 1e-6, otherwise as strings with
all whitespace removed.
"""
from __future__ import annotations

import re
from fractions import Fraction

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?|-?\.\d+")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}$")
_TEXT = re.compile(r"^\\(?:text|textbf|mathrm)\{(.*)\}$")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces, or None."""
    found = None
    for m in _BOXED.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            found = text[m.end() : i - 1]
    return found


def extract_answer(text: str) -> str | None:
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    nums = _NUMBER.findall(text)
    return nums[-1] if nums else None


def reference_answer(raw: str) -> str:
    if "####" in raw:
        return raw.rsplit("####", 1)[1].strip()
    boxed = last_boxed(raw)
    return boxed.strip() if boxed is not None else raw.strip()


def normalise(ans: str) -> str:
    s = ans.strip().replace("$", "").strip()
    m = _TEXT.match(s)
    if m:
        s = m.group(1).strip()
    s = s.rstrip(".").strip()
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    return s


def as_number(s: str) -> Fraction | float | None:
    s = s.replace(" ", "")
    m = _FRAC.match(s)
    if m:
        sign, num, den = m.groups()
        if int(den) == 0:
            return None
        v = Fraction(int(num), int(den))
        return -v if sign else v
    if re.fullmatch(r"-?\d+/\d+", s):
        num, den = s.split("/")
        return Fraction(int(num), int(den)) if int(den) else None
    if re.fullmatch(r"-?(?:\d+(?:\.\d*)?|\.\d+)", s):
        return Fraction(s)
    return None


def answers_match(pred: str | None, ref: str) -> bool:
    if pred is None:
        return False
    p, r = normalise(pred), normalise(ref)
    pn, rn = as_number(p), as_number(r)
    if pn is not None and rn is not None:
        return abs(float(pn) - float(rn)) <= 1e-6 * max(1.0, abs(float(rn)))
    return re.sub(r"\s+", "", p) == re.sub(r"\s+", "", r) and p != ""


def math_reward(response_text: str, ref: str) -> float:
    """1.0 when the response's extracted answer matches ``ref`` (already a reference
    answer, see :func:`reference_answer`), else 0.0 (also when no answer is found)."""
    return 1.0 if answers_match(extract_answer(response_text), ref) else 0.0
