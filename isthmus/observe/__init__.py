"""Watching a running server: Prometheus metrics and a live web view, on one port.

`isthmus up --metrics-port P` (and `isthmus run`) serves, from the server's own event loop,
so that what is read is read on the thread that changes it:

    /metrics     Prometheus text: `metrics.FleetCollector` reads the server's state when
                 scraped, and the counters the controller keeps as things happen
                 (`controller/counts.py`)
    /            the live view (page.html: one file, no build step), which polls
    /api/state   the view's data as JSON (`state.py`)

Recent fleet events (a worker lost or joined, a group formed, a compile, a lease granted)
come from the isthmus loggers, kept in a ring (`events.py`). Everything here only reads.
The parts: `options.py` (the command line), `observer.py` (what the head starts), `web.py`
(a GET-only HTTP/1.1 server).
"""
