"""Agent-session replay benchmark: ours (tiered-kv serve) side by side with ``mlx_lm.server``.

Modules: ``session`` (synthetic OpenCode-shaped requests), ``servers`` (subprocess lifecycle, peak RSS),
``replay`` (streaming client, per-request timings), ``report`` (table / JSON / plot, goal summary),
``micro`` (reload vs dd, lookup scaling, spill interference). ``engine/cli_bench.py`` drives them.
"""
