-- wrk script for bench/load_sim_engine.py: POST one chat completion per request.
-- The body comes from SIM_BENCH_BODY (set by the driver), else a 16-token chat.
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = os.getenv("SIM_BENCH_BODY")
  or '{"model":"bench","messages":[{"role":"user","content":"Hello, how are you today?"}],"max_tokens":16}'
