"""Shared helpers for exercise checks: the placeholder test, and how a check's verdict is shown.

A check raises ``AssertionError`` with one sentence when an answer is wrong. In a notebook that
sentence is what the reader needs, not the 25 lines of traceback through the check's own code,
so :func:`try_check` re-raises it as :class:`WrongAnswer`, which IPython renders as the sentence
alone (``_render_traceback_``). The cell still fails (an nbgrader test cell scores 0, Run All
stops at a wrong answer); an answer that is still the placeholder only prints a hint, so Run All
goes on past exercises nobody has tried yet.

A check never holds the answer it grades in readable form. The truth of each exercise is
computed by the instructor edition (``course/answers.py``, sealed by ``tools/seal_answers.py``)
and shipped here only sealed (:func:`sealed`, data in ``sealed_answers.json``): a discrete
answer as a salted, deliberately slow hash, a number as an encoded value (compared within a
tolerance; no check's feedback says which way an answer is off), what a success message reveals
encrypted under the right answer, and for a choice question each option's verdict encrypted
under that option (so the module holds no list of "why the wrong ones fail" whose missing entry
would name the right one); a reader's function is run on cases whose answers are sealed
(:func:`failing_cases`), or on cases drawn when the check runs (:func:`hidden_rng`), whose
answers kvlab's own planner, cost model, KV manager or scheduler computes then: the reader
cannot see those cases, so a table of answers cannot pass. Neither ``check_…??`` nor a read of
this package shows an answer. A prediction, whose few possible answers could be tried one after
another, is graded once (:func:`earlier_prediction`): the first wrong answer is kept in a file
beside the notebook, which a kernel restart does not clear. It is a seal against casual reading,
not cryptography: a determined student can decode a number or brute-force a small answer space
(the hash's 20,000 PBKDF2 rounds make that slow, not impossible), which is why grading that
matters runs through the course's hidden tests.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import functools
import hashlib
import json
import math
import random
import secrets
import struct
from dataclasses import dataclass
from importlib import resources
from pathlib import Path


class _OneLine(AssertionError):
    """An ``AssertionError`` that IPython shows as one red line instead of a traceback."""

    label = "Check"

    def _render_traceback_(self) -> list[str]:
        # IPython calls this instead of formatting the traceback; the lines go to the
        # notebook's error output (ename and evalue are kept, so graders still see the class).
        return [f"\x1b[0;31m{self.label}:\x1b[0m {self}"]


class NotYetAnswered(_OneLine):
    """Raised by a check when the reader's answer is still the placeholder (``...`` or None)."""

    label = "Not answered yet"


class WrongAnswer(_OneLine):
    """A check's verdict on a wrong answer: its one sentence, shown without a traceback."""

    label = "Not right yet"


def require_answer(value, what: str):
    """Raise :class:`NotYetAnswered` naming ``what`` if ``value`` is a placeholder."""
    if value is None or value is Ellipsis:
        raise NotYetAnswered(f"{what}: replace the placeholder with your answer, then re-run.")
    return value


def try_check(check, *args, **kwargs) -> str:
    """Call ``check``; print and return its message, or a hint when an answer is a placeholder.

    A wrong (non-placeholder) answer raises :class:`WrongAnswer` carrying the check's sentence
    (the check's own frames are dropped: they would show how the truth is computed). Errors that
    are not a check's verdict (a ``TypeError`` inside the reader's function, say) propagate with
    their traceback, which is then about the reader's code.
    """
    try:
        message = check(*args, **kwargs)
    except NotYetAnswered as hint:
        message = f"Not answered yet — {hint}"
    except WrongAnswer:
        raise
    except AssertionError as verdict:
        raise WrongAnswer(str(verdict) or "the answer does not pass the check.") from None
    print(message)
    return message


# --- predictions ---------------------------------------------------------------------------------

#: Wrong predictions recorded so far: exercise key -> (canonical form, the answer). The record
#: is kept in :data:`_PREDICTION_FILE` too (relative to the working directory, which in Jupyter
#: is the notebook's folder), so a kernel restart does not forget a prediction; nothing public
#: clears it (tests reset ``_PREDICTIONS`` and point ``_PREDICTION_FILE`` elsewhere directly).
_PREDICTIONS: dict[str, tuple[str, object]] = {}
_PREDICTION_FILE: Path | None = Path(".kvlab-predictions.json")


def _recorded() -> dict[str, tuple[str, object]]:
    """The record, with what an earlier session left in :data:`_PREDICTION_FILE` merged in."""
    if _PREDICTION_FILE is not None and _PREDICTION_FILE.is_file():
        try:
            stored = json.loads(_PREDICTION_FILE.read_text())
        except (OSError, ValueError):
            stored = {}
        for key, text in stored.items():
            if isinstance(text, str):
                _PREDICTIONS.setdefault(key, (text, json.loads(text)))
    return _PREDICTIONS


def _record(key: str, text: str, answer) -> None:
    _PREDICTIONS[key] = (text, copy.deepcopy(answer))
    if _PREDICTION_FILE is not None:
        with contextlib.suppress(OSError):   # a read-only folder: it lasts this session
            _PREDICTION_FILE.write_text(json.dumps(
                {k: t for k, (t, _) in sorted(_PREDICTIONS.items())}, indent=1))


def earlier_prediction(key: str, answer, right: bool):
    """For a prediction exercise, whose answers are few enough to find by trying: the wrong
    prediction recorded for ``key`` earlier (in this session, or in an earlier one run from the
    same folder) that ``answer`` differs from, or None when ``answer`` is to be graded itself.
    A wrong ``answer`` is recorded when none is; a right one locks nothing (a worked solution
    run before the reader answers must not take the reader's turn). So after a wrong
    prediction, every other answer gets the same reply, and trying them one after another
    learns nothing. Call it only with an answer of the right form."""
    text = canonical(answer)
    record = _recorded()
    if key in record:
        first_text, first = record[key]
        return None if text == first_text else first
    if not right:
        _record(key, text, answer)
    return None


def graded_once(first) -> str:
    """The reply to an answer given after a wrong prediction: the prediction stands, and
    nothing is said about the new answer."""
    return (f"Your prediction, recorded when you first answered, was {first!r}, and it was not "
            "right; a prediction is graded once, so a later answer is not graded. Now run the "
            "experiment and work out why it was not.")


# --- sealed answers -----------------------------------------------------------------------------

#: PBKDF2 rounds of a sealed answer's hash (about 10 ms a try: a check stays instant, a
#: brute force over a large answer space does not).
SEAL_ROUNDS = 20_000


def canonical(value) -> str:
    """The text a sealed answer is hashed from: JSON with tuples as lists, integral floats as
    ints, sorted keys, so ``(1, 2)``, ``[1, 2]`` and ``[1.0, 2]`` seal alike. Raises
    ``TypeError`` naming the value if it is not made of numbers, strings, lists and dicts."""

    def norm(v):
        if isinstance(v, bool) or v is None or isinstance(v, str):
            return v
        if isinstance(v, int):
            return v
        if isinstance(v, float):
            if not math.isfinite(v):
                raise TypeError(f"a sealed answer must be finite, got {v!r}")
            return int(v) if v.is_integer() else v
        if isinstance(v, (list, tuple)):
            return [norm(x) for x in v]
        if isinstance(v, dict):
            return {str(k): norm(x) for k, x in v.items()}
        if hasattr(v, "item") and callable(v.item):    # a numpy or torch scalar
            return norm(v.item())
        raise TypeError(f"cannot seal or compare {type(v).__name__} {v!r}")

    return json.dumps(norm(value), sort_keys=True, separators=(",", ":"))


def _derive(salt: str, value, purpose: bytes) -> bytes:
    return hashlib.pbkdf2_hmac("sha256", purpose + canonical(value).encode(),
                               bytes.fromhex(salt), SEAL_ROUNDS)


def _stream(seed: bytes, n: int) -> bytes:
    out, counter = b"", 0
    while len(out) < n:
        out += hashlib.sha256(seed + counter.to_bytes(4, "big")).digest()
        counter += 1
    return out[:n]


def _xor(data: bytes, seed: bytes) -> bytes:
    return bytes(a ^ b for a, b in zip(data, _stream(seed, len(data)), strict=True))


@dataclass(frozen=True)
class Sealed:
    """One exercise's sealed truth (see the module docstring); made by :func:`seal`, read by
    :func:`sealed`. ``digest`` seals the exact answer, ``number`` (optional) its value for
    direction feedback, ``reveal`` (optional) facts a success message may show, ``notes``
    (optional) one verdict per option of a choice question, each opened by its option."""

    key: str
    salt: str
    digest: str
    number: str | None = None
    reveal: str | None = None
    notes: dict | None = None

    def is_answer(self, value) -> bool:
        """Whether ``value`` is the sealed answer (in :func:`canonical` form)."""
        try:
            return _derive(self.salt, value, b"answer:").hex() == self.digest
        except TypeError:
            return False

    def value(self) -> float:
        """The sealed number (for "too high" / "too low"); ``KeyError`` if none was sealed."""
        if self.number is None:
            raise KeyError(f"{self.key} seals no number")
        raw = _xor(base64.b64decode(self.number), b"kvlab-number:" + self.key.encode())
        return struct.unpack("<d", raw)[0]

    def direction(self, got: float, tolerance: float = 0.0) -> str | None:
        """``"too high"``, ``"too low"``, or None when ``got`` is within ``tolerance``."""
        truth = self.value()
        if abs(got - truth) <= tolerance:
            return None
        return "too high" if got > truth else "too low"

    def revealed(self, answer) -> dict:
        """The sealed facts, opened with the right ``answer``; ``ValueError`` if it is not."""
        if self.reveal is None:
            return {}
        if not self.is_answer(answer):
            raise ValueError(f"{self.key}: only the right answer opens its facts")
        plain = _xor(base64.b64decode(self.reveal), _derive(self.salt, answer, b"reveal:"))
        return json.loads(plain.decode())

    def note(self, option) -> str | None:
        """The sealed verdict on ``option`` (why it fails, or the success message for the right
        one), or None when no verdict was sealed for it."""
        if not self.notes:
            return None
        try:
            sealed_note = self.notes.get(_derive(self.salt, option, b"note-id:").hex()[:24])
        except TypeError:
            return None
        if sealed_note is None:
            return None
        key = _derive(self.salt, option, b"note:")
        return _xor(base64.b64decode(sealed_note), key).decode()


def seal(key: str, answer, *, number: float | None = None, reveal: dict | None = None,
         notes: dict | None = None, salt: str | None = None) -> Sealed:
    """Seal ``answer`` under ``key`` (instructor side: ``tools/seal_answers.py``). The salt
    is derived from the key unless given, so sealing the same truth twice gives the same text
    and a drifted truth shows as a changed line."""
    salt = salt or hashlib.sha256(b"kvlab-salt:" + key.encode()).hexdigest()[:32]
    digest = _derive(salt, answer, b"answer:").hex()
    enc_number = None
    if number is not None:
        raw = struct.pack("<d", float(number))
        enc_number = base64.b64encode(_xor(raw, b"kvlab-number:" + key.encode())).decode()
    enc_reveal = None
    if reveal:
        plain = json.dumps(reveal, sort_keys=True).encode()
        enc_reveal = base64.b64encode(_xor(plain, _derive(salt, answer, b"reveal:"))).decode()
    enc_notes = None
    if notes:
        enc_notes = {}
        for option, text in sorted(notes.items()):
            cipher = _xor(text.encode(), _derive(salt, option, b"note:"))
            enc_notes[_derive(salt, option, b"note-id:").hex()[:24]] = base64.b64encode(
                cipher).decode()
    return Sealed(key, salt, digest, enc_number, enc_reveal, enc_notes)


def sealed(key: str) -> Sealed:
    """The sealed truth of exercise ``key`` (``"ch01.kv_bytes_per_token"``); ``KeyError``
    naming the key and the command that seals it when it is missing."""
    try:
        return Sealed(key, *_sealed_table()[key])
    except KeyError:
        raise KeyError(f"no sealed answer for {key!r}: run `python tools/seal_answers.py "
                       "--write` (instructor edition)") from None


def failing_cases(fn, key: str, cases) -> list[int]:
    """Indices of ``cases`` (keyword dicts) on which the reader's ``fn(**case)`` is not the
    truth sealed under ``f"{key}.{i}"``: a check of a reader's function against cases whose
    answers the package does not hold. Whatever ``fn`` raises propagates (it is about the
    reader's code)."""
    return [i for i, case in enumerate(cases)
            if not sealed(f"{key}.{i}").is_answer(fn(**case))]


def hidden_rng() -> random.Random:
    """A generator seeded anew from the operating system at every call. A check that runs a
    reader's function on cases drawn from it runs cases no page or module lists, different at
    each call, so a rule cannot be tuned to them one by one; it says only whether the function
    agreed on every case, never which case failed or how many did."""
    return random.Random(secrets.randbits(64))


@functools.cache
def _sealed_table() -> dict[str, list]:
    """``sealed_answers.json`` (package data written by ``tools/seal_answers.py``)."""
    text = resources.files(__package__).joinpath("sealed_answers.json").read_text()
    return json.loads(text)
