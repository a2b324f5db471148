"""A PS whose chief died serves on (a chief started again resumes the run) but says
so: it knows how long no chief probed it (``ps_state``, sent every heartbeat interval
while a chief runs). A PS orphaned by a killed chief ran for minutes without a word."""

from __future__ import annotations

import time

from test_ps_client import ALL, make_cluster, run


def test_the_ps_knows_how_long_its_chief_has_been_silent() -> None:
    async def body() -> None:
        c = await make_cluster(ALL, 1, 1)
        ps = c.services[0]
        assert ps.chief_silent_for() is None  # no chief ever probed it
        await c.net.client("ps0", "chief:0").request("ps_state", {})
        heard = time.monotonic()
        silent = ps.chief_silent_for()
        assert silent is not None and 0 <= silent <= time.monotonic() - heard + 0.5
        later = ps.chief_silent_for(now=heard + 90)
        assert later is not None and later >= 89.5

    run(body())
