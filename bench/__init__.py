"""Every benchmark of tiered-kv, outside the library (results in ``bench/results/``).

The agent-session replay, ours (tiered-kv serve) side by side with ``mlx_lm.server`` (`tiered-kv bench`,
driven by ``run``): ``session`` (synthetic OpenCode-shaped requests), ``servers`` (subprocess lifecycle, peak
RSS), ``replay`` (streaming client, per-request timings), ``report`` (table / JSON / plot, goal summary),
``micro`` (reload vs dd, lookup scaling, spill interference), ``concurrency`` (K sessions at once).
The others run alone: ``python -m bench.NAME`` (each module's docstring has its command).
Needs the ``bench`` extra (httpx, psutil, tqdm, matplotlib): ``pip install 'tiered-kv[bench]'``.
"""
