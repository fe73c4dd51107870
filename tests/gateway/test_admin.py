"""Admin routes: pushed signals feed the policy; state and metrics show what it knows."""

from __future__ import annotations

import httpx

from gateway.helpers import openai_error


async def test_pushed_samples_reach_the_policy_and_the_metrics(
    refused_url: str, gateway_factory
) -> None:
    # The only backend cannot be scraped, so whatever the policy knows came by push.
    gw = await gateway_factory([refused_url], overrides={"server.admin_token": "s3cret"})
    node = refused_url.removeprefix("http://")
    sample = {"node": node, "kv_usage": 0.5, "kv_capacity_tokens": 1000, "running": 3,
              "waiting": 1, "iteration_latency_s": 0.02}  # fmt: skip
    auth = {"Authorization": "Bearer s3cret"}
    async with httpx.AsyncClient(base_url=gw.url) as client:
        anonymous = await client.post("/admin/signals", json=sample)
        accepted = await client.post("/admin/signals", json=[sample], headers=auth)
        bad = await client.post("/admin/signals", json={**sample, "kv_usage": 7}, headers=auth)
        stranger = await client.post(
            "/admin/signals", json={**sample, "node": "elsewhere:1"}, headers=auth
        )
        state = (await client.get("/admin/state", headers=auth)).json()
        metrics = (await client.get("/metrics")).text
    assert anonymous.status_code == 401
    assert accepted.status_code == 202 and accepted.json() == {"accepted": 1}
    assert bad.status_code == 400 and openai_error(bad.content)["param"] == "kv_usage"
    assert stranger.status_code == 400 and openai_error(stranger.content)["code"] == "unknown_node"
    assert state["policy"]["nodes"][node]["sample"]["kv_usage"] == 0.5
    assert state["gateway"]["in_flight"] == 0
    assert f'kvgate_node_kv_usage{{node="{node}"}} 0.5' in metrics


async def test_metrics_count_requests_by_route_status_and_backend(
    fake_engine, gateway_factory
) -> None:
    gw = await gateway_factory([fake_engine.url])
    async with httpx.AsyncClient(base_url=gw.url) as client:
        for _ in range(3):
            await client.post("/v1/completions", json={"model": "fake-model", "prompt": "p"})
        await client.post("/v1/completions", json={"model": "nope", "prompt": "p"})
        text = (await client.get("/metrics")).text
    backend = f"127.0.0.1:{fake_engine.port}"
    assert (
        f'kvgate_requests_total{{backend="{backend}",route="/v1/completions",status="200"}} 3.0'
        in text
    )
    assert 'kvgate_requests_total{backend="-",route="/v1/completions",status="404"} 1.0' in text
    assert "kvgate_requests_in_flight 0.0" in text
    assert (
        'kvgate_admissions_total{decision="admitted",priority="standard",reason="admitted"} 3.0'
        in text
    )
    assert 'kvgate_time_to_first_byte_seconds_count{route="/v1/completions"} 4.0' in text
    # the scraper's durations become a histogram at collection time
    count = [
        line for line in text.splitlines()
        if line.startswith(f'kvgate_scrape_duration_seconds_count{{node="{backend}"}}')
    ]  # fmt: skip
    assert count and float(count[0].rsplit(" ", 1)[1]) >= 1
