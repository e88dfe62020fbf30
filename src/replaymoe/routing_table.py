"""Deprecated: moved to :mod:`replaymoe.routing.methods` (this alias is kept for one release).

``GRAD_KIND`` (closed-form gradient -> the backward kernel's number) is now a property of each
formula, :attr:`replaymoe.routing.methods.Formula.kernel`; the mapping is rebuilt here from the table.
"""

from replaymoe._deprecated import alias
from replaymoe.routing import methods

GRAD_KIND = {s.formula.grad: s.formula.kernel for s in methods.METHODS.values() if s.formula.grad_kernel}
__all__ = [*methods.__all__, "GRAD_KIND"]

alias(globals(), methods)
