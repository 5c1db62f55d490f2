"""CPython's multiprocessing tests, built against one namespace: gpushare's or multiprocessing's.

``test._test_multiprocessing`` writes each test once, against a "type"
mixin whose attributes are the namespace under test (``self.Process``,
``self.Queue``, ``self.Barrier`` ...), and
``install_tests_in_module_dict`` turns every ``_TestX`` into a
``With<Type>TestX`` class in the module that asks. This module does that,
after pointing the mixins at the namespace named by
``GPUSHARE_COMPAT_TARGET`` (``gpushare`` or ``multiprocessing``):

* ``processes``: every ``ProcessesMixin`` attribute that the namespace has
  (``Process``, ``Pool``, ``Pipe``, ``Queue``, ``Lock``, ``Barrier``,
  ``Value``, ``Array`` ...) is taken from it;
* ``manager``: ``Process`` is taken from it and ``setUpClass`` builds the
  class's Manager with the namespace's ``Manager()`` (a started
  :class:`gpushare.BufferManager` for gpushare); every other object comes
  from that Manager, as in the stdlib.

``GPUSHARE_COMPAT_TYPE`` picks the type. Spawned children import this
module by name to find their targets (classmethods of the built classes),
so it must build the same classes there: both settings travel in the
environment. ``run.py`` is the runner.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

import test._test_multiprocessing as suite

TARGET = os.environ.get("GPUSHARE_COMPAT_TARGET", "gpushare")
TYPE = os.environ.get("GPUSHARE_COMPAT_TYPE", "processes")
START_METHOD = "spawn"

if TARGET == "gpushare":
    import gpushare as namespace
elif TARGET == "multiprocessing":
    namespace = multiprocessing
else:
    raise SystemExit(f"GPUSHARE_COMPAT_TARGET={TARGET!r}: use 'gpushare' or 'multiprocessing'")
if TYPE not in ("processes", "manager"):
    raise SystemExit(f"GPUSHARE_COMPAT_TYPE={TYPE!r}: use 'processes' or 'manager'")


def _point_processes_mixin_at(ns: Any) -> None:
    mixin = suite.ProcessesMixin
    for name, value in list(vars(mixin).items()):
        if name == "Process":
            mixin.Process = ns.Process
        elif isinstance(value, staticmethod) and hasattr(ns, name):
            setattr(mixin, name, staticmethod(getattr(ns, name)))


def _point_manager_mixin_at(ns: Any) -> None:
    mixin = suite.ManagerMixin
    mixin.Process = ns.Process

    def setUpClass(cls: Any) -> None:
        super(mixin, cls).setUpClass()
        cls.manager = ns.Manager()

    mixin.setUpClass = classmethod(setUpClass)  # type: ignore[assignment]


if namespace is not multiprocessing:
    _point_processes_mixin_at(namespace)
    _point_manager_mixin_at(namespace)

suite.install_tests_in_module_dict(globals(), START_METHOD, only_type=TYPE)
