"""The reliability harness: `statebudget serve` as a real process under load, killed and restarted.

`python -m planner_service.soak` (`make soak`) runs every trial and writes `docs/reliability.md`; the
bounded versions run in `tests/e2e/test_soak.py`. It talks to the service only over HTTP on loopback
(httpx, the answers read as `planner_service.wire` types), so what it measures is what a client sees:

- `load`: the demo (or a generated 50-node cluster), node agents leasing and reporting done and session
  events at a steady rate; the confirmed state is checked while it runs (capacity, object sizes), the
  reported operations are replayed onto the seeded placement at the end and compared with the service's,
  and the service is restarted on its database and must come back with the same SRV;
- `kill`: SIGKILL at a random moment under mixed load, restart on the same database: every acknowledged
  event and report is still there, a resent one is a duplicate, and the database passes its integrity check;
- `faults`: the bad inputs and races of the reliability issue against the real server, each with its answer.
"""
