"""``inferq dashboard``: a read-only live web page of one deployment (the ``dashboard`` extra).

Server-rendered HTML (Starlette, served by uvicorn) refreshed every two seconds from
``/fragment``; ``/api/state`` gives the same data as JSON, which the page also reads
to draw the queue and SLA charts with uPlot (MIT, vendored in ``static/`` with its
license: no CDN, no front-end build step). It shows queues per route and class with
the oldest wait, workers with state, slots, KV cache and health, SLA attainment per
class over the last minutes, recent events and the dead letter. It writes nothing.
"""

from inferq.dashboard.state import SLA_WINDOW_S, dashboard_state, sla_attainment

__all__ = ["SLA_WINDOW_S", "dashboard_state", "sla_attainment"]
