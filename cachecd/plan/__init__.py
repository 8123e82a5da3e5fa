"""Know before you run: ``cachecd doctor`` measures the machine, ``cachecd plan`` projects a
model's speed on it.

Modules: ``disk_probe`` (cold and page-cache reads of a cache dir), ``host`` (memory, swap,
MLX), ``network_probe`` (the endpoint's resolve and one range), ``doctor`` (the command),
``routing`` (the calls a workload makes: a trace's, or flat routing), ``simulate`` (those calls
through the engine's slot table and the store's eviction policy), ``speed`` (the model of a
token's time), ``probe`` (the compute of a MoE layer and the engine's costs per call,
measured), ``token_probe`` (the compute of a whole decode token, the model built from its
config.json), ``model_source`` (which model: a manifest file, the daemon's, a shipped one, or
the Hub's), ``hub_model`` (a model not installed, from its config.json and shard headers),
``plan`` (the command), ``render`` (table, JSON, PNG).

Invariant: the figures a plan uses are the doctor's (measured now or read from its JSON) and the
engine's own rules (``cachecd_engine.pool.memory.pool_bytes_for``, ``SlotTable``, the store's
policies); a projection never uses a constant tuned to a machine.
"""
