"""Tools that go together (issue 31 item 2): rules learned from the order tools were called in,
and a real server that, after real clients reported calls in that order, injects the usual
prerequisite beside the tool a turn asks for, with the steps in order."""

from __future__ import annotations

import asyncio

from sidecar import config as config_mod
from sidecar.core import models
from sidecar import protocol as p
from sidecar.client import SidecarClient
from sidecar.engine import Sidecar
from sidecar.recommend.sequences import SequenceFit
from sidecar.serve.server import SidecarServer

from .conftest import CATALOGS

BOUND_S = 300


def test_rules_need_evidence_and_say_which_way_round():
    sessions = [["create_directory", "move_file"]] * 8 + [["read_file"]] * 10 + [["create_directory", "read_file"]] * 2
    seqs = SequenceFit().fit(sessions)
    after = seqs.around("create_directory")
    before = seqs.around("move_file")
    assert [(r.tool, r.relation, r.together, r.sessions) for r in after] == [("move_file", "after", 8, 10)]
    assert [(r.tool, r.relation, r.together, r.sessions) for r in before] == [("create_directory", "before", 8, 8)]
    assert before[0].why == "called before move_file in 8 of 8 sessions"
    assert seqs.around("read_file") == []  # read_file is everywhere: beside create_directory it is no likelier (lift 1.2)
    assert len(SequenceFit().fit(sessions[:4])) == 0  # 4 sessions together: under min_together, nothing invented
    assert len(SequenceFit().fit([])) == 0
    far = [["create_directory", "a", "b", "c", "move_file"]] * 8
    assert SequenceFit(window=3).fit(far).around("move_file") == []  # four calls apart: not one step of the other


def test_a_server_injects_the_usual_prerequisite_in_order_after_clients_called_them_so(tmp_path):
    cfg = config_mod.load(env={}, overrides={("model", "name"): models.SMALL_MODEL, ("catalogs",): [str(CATALOGS / "filesystem.json")],
                                             ("store",): str(tmp_path / "s.db"), ("server", "port"): 0,
                                             ("learn", "refit_every"): 32})  # fmt: skip
    ask = "move final_report.pdf into the archive folder"

    async def injects(server: SidecarServer, stream: str) -> list[p.Inject]:
        async with await SidecarClient.connect(server.url, session="asker") as sc:
            await sc.user(stream, ask)
            await sc.end(stream)
            got = []
            while not isinstance(m := await sc.recv(60), p.Ended):
                if isinstance(m, p.Inject):
                    got.append(m)
            return got

    async def body():
        server = SidecarServer(cfg, engine=Sidecar.open(cfg, progress=False))
        await server.start()
        try:
            cold = await injects(server, "cold")
            # eight agents each make a folder and then move a file into it; eight others only read
            for i, calls in enumerate([("create_directory", "move_file")] * 8 + [("list_directory", "read_text_file")] * 8):
                async with await SidecarClient.connect(server.url, session=f"agent{i}") as sc:
                    for k, tool in enumerate(calls):
                        await sc.tool_result(tool, ok=True, latency_ms=5.0, ref=k)
                        assert isinstance(await sc.recv(60), p.Ack)
            for _ in range(200):
                await server.learner.drain()
                if len(server.engine.sequences):
                    break
                await asyncio.sleep(0.05)
            warm = await injects(server, "warm")
            return cold, warm
        finally:
            await server.shutdown()

    cold, warm = asyncio.run(asyncio.wait_for(body(), BOUND_S))
    assert cold and not any(m.workflow for m in cold)  # cold start: no sequence, no workflow
    assert "create_directory" not in {t.definition["name"] for m in cold for t in m.tools}
    tools = [t.definition["name"] for t in warm[0].tools]
    assert tools[0] == "move_file" and "create_directory" in tools, tools
    order = [s.tool for s in warm[0].workflow]
    assert order.index("create_directory") < order.index("move_file"), order
    why = next(s.why for s in warm[0].workflow if s.tool == "create_directory")
    assert why == "called before move_file in 8 of 8 sessions"
    assert [s.step for s in warm[0].workflow] == list(range(1, len(warm[0].workflow) + 1))
