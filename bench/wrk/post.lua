-- POST pre-built request bodies to the URL wrk was given; print one JSON summary line.
--
--     wrk -t1 -c64 -d15s --latency -s bench/wrk/post.lua \
--         http://127.0.0.1:8080/predictions/dlrm -- BODIES [THREADS]
--
-- BODIES is a list file, or a folder holding one named index.txt. Each line of it is
--     <file> <instances>
-- (file relative to the list's folder, instances = instances in that body; blank lines
-- and lines starting with # are skipped). Every body is read once, at init, and sent as
-- Content-Type: application/json. THREADS (optional) is wrk's -t, for the offsets below.
-- python -m bench.bench_autotune writes these folders.
--
-- Each wrk thread cycles through all bodies in order, starting at a different offset
-- (see init()), so that threads do not send the same body at the same time and every
-- body is sent about equally often.
--
-- done() prints ONE line, "JSON {...}", with:
--   requests       completed requests (wrk's count)
--   duration_us    the run's length in microseconds (from start to stop; SIGINT included)
--   errors         socket errors: connect + read + write + timeout
--   non2xx         answers whose status is not 2xx (counted in response(): wrk's own
--                  summary.errors.status counts only statuses > 399, so a 1xx/3xx answer
--                  would pass unseen; status_errors is wrk's count, kept for comparison)
--   p50_us, p90_us, p99_us, max_us   latency percentiles in microseconds
--   requests_sent, instances_sent    requests written and their instances
-- response() is not told which request it answers, so the instances of completed
-- requests cannot be counted here. The bench derives samples/s as
-- requests/s x (instances_sent / requests_sent): the mean instances of what was sent,
-- which differs from what was answered by at most the requests in flight at the stop.

local threads = {}
local next_id = 0

function setup(thread)
   thread:set("id", next_id)
   next_id = next_id + 1
   table.insert(threads, thread)
end

local function dirname(path)
   return path:match("^(.*)/[^/]*$") or "."
end

local function read_file(path)
   local f, err = io.open(path, "rb")
   if not f then
      error("post.lua: cannot read " .. path .. ": " .. tostring(err))
   end
   local data = f:read("*a")
   f:close()
   return data
end

local reqs = {}
local counts = {}
local pos = 1

function init(args)
   local list = args[1]
   if list == nil or list == "" then
      error("post.lua: give the bodies after --: wrk ... -s post.lua URL -- DIR|LIST")
   end
   local f = io.open(list .. "/index.txt", "r")
   local base
   if f then
      base = list
   else
      f = io.open(list, "r")
      if not f then
         error("post.lua: " .. list .. " is neither a list file nor a folder with index.txt")
      end
      base = dirname(list)
   end
   local headers = { ["Content-Type"] = "application/json" }
   for line in f:lines() do
      if line:match("%S") and not line:match("^%s*#") then
         local name, n = line:match("^%s*(%S+)%s+(%d+)%s*$")
         if not name then
            error("post.lua: bad line in " .. list .. ": '" .. line .. "' (want: FILE INSTANCES)")
         end
         -- wrk.format adds Content-Length and Host; nil path = the URL's path.
         table.insert(reqs, wrk.format("POST", nil, headers, read_file(base .. "/" .. name)))
         table.insert(counts, tonumber(n))
      end
   end
   f:close()
   if #reqs == 0 then
      error("post.lua: " .. list .. " lists no bodies")
   end
   -- wrk runs each thread's setup() and init() before the next thread's setup(), so a
   -- thread cannot count the others: the thread count comes as the second script
   -- argument (thread k of n starts at k/n of the list). Without it, offsets step by the
   -- golden ratio (0, .618, .236, .854, ... of the list): spread, if not always distinct.
   local n = tonumber(args[2])
   local frac = n and (id / n) or ((id * 0.6180339887498949) % 1)
   pos = math.floor(frac * #reqs) % #reqs + 1
   requests_sent = 0
   instances_sent = 0
   non2xx = 0
end

function request()
   local i = pos
   pos = pos % #reqs + 1
   requests_sent = requests_sent + 1
   instances_sent = instances_sent + counts[i]
   return reqs[i]
end

function response(status, headers, body)
   if status < 200 or status > 299 then
      non2xx = non2xx + 1
   end
end

function done(summary, latency, requests)
   local sent, inst, bad = 0, 0, 0
   for _, t in ipairs(threads) do
      sent = sent + (t:get("requests_sent") or 0)
      inst = inst + (t:get("instances_sent") or 0)
      bad = bad + (t:get("non2xx") or 0)
   end
   local e = summary.errors
   io.write(string.format(
      'JSON {"requests": %d, "duration_us": %d, "errors": %d, "connect_errors": %d, '
      .. '"read_errors": %d, "write_errors": %d, "timeouts": %d, "non2xx": %d, '
      .. '"status_errors": %d, "p50_us": %d, "p90_us": %d, "p99_us": %d, "max_us": %d, '
      .. '"requests_sent": %d, "instances_sent": %d, "threads": %d}\n',
      summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout,
      e.connect, e.read, e.write, e.timeout, bad, e.status,
      latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max,
      sent, inst, #threads))
end
