"""handlers/dlrm_handler.py as TorchServe loads it: one class in the module (TorchServe
refuses a handler module with two), and TorchServe's per-batch lines dropped in the worker."""
from __future__ import annotations

import inspect
import logging

import handlers.dlrm_handler as mod


def test_the_module_defines_exactly_one_class():
    # TorchServe's loader: "Expected only one class in custom service code"
    own = [c for _, c in inspect.getmembers(mod, inspect.isclass) if c.__module__ == mod.__name__]
    assert own == [mod.DLRMHandler]


def test_per_batch_lines_are_dropped_and_the_rest_kept(caplog):
    root = logging.getLogger()
    try:
        mod._quiet_per_batch_lines()
        mod._quiet_per_batch_lines()          # idempotent: one filter
        assert root.filters.count(mod._keep_line) == 1
        with caplog.at_level(logging.INFO):
            # TorchServe's worker logs this line on the root logger, as here
            logging.info("Backend received inference at: %d", 123)  # noqa: LOG015
            logging.info("delta small #1 applied")  # noqa: LOG015
            logging.getLogger("ts.metrics.caching_metric").info("HandlerTime.Milliseconds:1")
            logging.getLogger("ts.metrics.caching_metric").warning("Overriding dimensions")
        # caplog's handler sits on the root logger: what reaches it reaches the model log
        msgs = [r.getMessage() for r in caplog.records]
        assert msgs == ["delta small #1 applied", "Overriding dimensions"]
    finally:
        root.removeFilter(mod._keep_line)
        logging.getLogger("ts.metrics.caching_metric").setLevel(logging.NOTSET)
