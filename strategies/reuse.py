"""``hypothesis.strategies``, with ``sampled_from``, ``just``, ``one_of`` and ``tuples`` built once per arguments.

:func:`strategies.attention.attention_cases` builds its strategies inside the draw (their bounds depend on what
was drawn before), so every example built dozens of new strategy objects, and Hypothesis validated each new
object and computed its label on its first draw: about a third of the time a case took to draw. Hypothesis
already reuses ``integers``, ``floats`` and ``booleans`` built from equal arguments; this module does the same
for the four constructors above. A strategy draws the same choices whichever equal-argument instance draws
them, so the examples, their order and their shrinking stay as they were, byte for byte.

Arguments are told apart by type as well as value (``1``, ``1.0`` and ``True``; ``0.0`` and ``-0.0``), strategies
by identity. Only numbers, strings, None, strategies, frozen dataclasses and lists, tuples and ranges of them are
keys; any other argument (a tensor, whose hash is its identity) builds a new strategy, as before. Everything else
is ``hypothesis.strategies`` itself.
"""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as _st

_LIMIT = 4096  # strategies kept; past it the cache starts again (a pool of 24 rows and the Limits give a few hundred)
_BUILT: dict = {}


def _strict(x):
    """A key for ``x`` that ``==`` and ``hash`` cannot confuse with another value's; TypeError for an argument
    that is not a key (see the module's docstring)."""
    if isinstance(x, (list, tuple, range)):
        return (type(x).__name__, *map(_strict, x))
    if isinstance(x, float):
        return ("float", x.hex())
    frozen = dataclasses.is_dataclass(x) and not isinstance(x, type) and x.__dataclass_params__.frozen
    if x is None or frozen or isinstance(x, (int, str, _st.SearchStrategy)):
        return (type(x), x)
    raise TypeError(f"{type(x).__name__} is not a key")


def _reused(make):
    def build(*args):
        try:
            key = (make.__name__, _strict(args))
            return _BUILT[key]
        except TypeError:  # an argument that is not a key, or cannot be hashed
            return make(*args)
        except KeyError:
            if len(_BUILT) >= _LIMIT:
                _BUILT.clear()
            _BUILT[key] = strategy = make(*args)
            return strategy

    build.__name__ = build.__qualname__ = make.__name__
    build.__doc__ = make.__doc__
    return build


sampled_from = _reused(_st.sampled_from)
just = _reused(_st.just)
one_of = _reused(_st.one_of)
tuples = _reused(_st.tuples)


def __getattr__(name: str):
    return getattr(_st, name)
