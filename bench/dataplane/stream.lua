-- wrk script: the same ~1 KB chat request with "stream": true, plus the header
-- x-bench-stream: 1 that tells the nginx upstream to answer with its 65-event
-- SSE stream (nginx cannot read the JSON body). wrk de-chunks the body; each
-- answer must hold exactly 65 events and end with "data: [DONE]"; a wrong one is
-- counted and printed as "BENCH_BAD <n>" at the end.
wrk.method = "POST"
wrk.path = "/v1/chat/completions"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer sk-bench"
wrk.headers["X-Bench-Stream"] = "1"
wrk.body = '{"model":"m","messages":[{"role":"system","content":"You are a helpful assistant. Answer concisely and accurately. If you do not know the answer, say so plainly instead of guessing. Use plain text without markdown formatting unless the user asks for it. Prefer short sentences, and when there are several options, give the best one first and explain briefly why you chose it over the others."},{"role":"user","content":"I am planning a three-day trip to Lisbon in late spring with two friends who like food, history and long walks. We will arrive on a Thursday morning and leave on Sunday evening. Please suggest a rough plan for each day, with one neighbourhood to explore in the morning, one place to eat lunch and one thing to do in the evening, and tell us which tram or metro lines are the most useful. Keep the whole answer under two hundred words and mention one thing we should book in advance."}],"max_tokens":256,"temperature":0.7,"top_p":0.95,"stream":true,"user":"bench-user-0001"}'

local bad = 0
local threads = {}
local EVENTS = 65

function setup(thread)
  table.insert(threads, thread)
end

function response(status, headers, body)
  if status ~= 200 or body:sub(-14) ~= "data: [DONE]\n\n" then
    bad = bad + 1
    return
  end
  local _, n = body:gsub("\n\n", "")
  if n ~= EVENTS then
    bad = bad + 1
  end
end

function done(summary, latency, requests)
  local total = 0
  for _, t in ipairs(threads) do
    total = total + (t:get("bad") or 0)
  end
  io.write(string.format("BENCH_BAD %d\n", total))
end
