"""A worker's error records travel to the controller (`worker/incidents.py`)."""

import asyncio
import logging

from isthmus.transport import messages as m
from isthmus.worker import incidents
from isthmus.worker.incidents import IncidentForwarder


def test_errors_and_tracebacks_go_warnings_stay_and_a_flood_is_counted(monkeypatch):
    asyncio.run(asyncio.wait_for(_main(monkeypatch), 10))


async def _main(monkeypatch):
    sent = []
    forwarder = IncidentForwarder(sent.append, asyncio.get_running_loop())
    log = logging.getLogger("isthmus.test.incidents")
    log.addHandler(forwarder)
    log.propagate = False
    try:
        log.warning("just a warning")  # no traceback: stays in the worker's log
        try:
            raise ValueError("broken")
        except ValueError:
            log.warning("a warning with its traceback", exc_info=True)
        log.error("an error")
        assert [i.message for i in sent] == ["a warning with its traceback", "an error"]
        assert isinstance(sent[0], m.Incident) and "ValueError: broken" in sent[0].traceback
        assert sent[1].level == "ERROR" and sent[1].source == "isthmus.test.incidents"
        monkeypatch.setattr(incidents, "BURST", 3)
        for i in range(5):
            log.error("flood %d", i)
        assert [i.message for i in sent[2:]] == ["flood 0"]  # 3 within the period
        monkeypatch.setattr(incidents, "PERIOD", 0.0)
        log.error("after the flood")
        assert sent[-1].message == "after the flood" and sent[-1].dropped == 4
    finally:
        log.removeHandler(forwarder)
