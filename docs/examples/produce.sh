#!/usr/bin/env bash
# Produce one batchd job and print its answer as it is generated, with nothing but
# redis-cli and jq: the raw wire protocol, as a service in any language speaks it.
#
#   bash produce.sh "What is the capital of France?" [QUEUE]
#
# The Redis is $BATCHD_REDIS_URL (default redis://127.0.0.1:6379/0). Prints the job id on
# stderr, the text on stdout, then the finish reason on stderr; exits 0 when the job
# finished (stop or length), 1 when it failed, was cancelled or expired.
set -euo pipefail

prompt=${1:?usage: produce.sh PROMPT [QUEUE]}
queue=${2:-default}
url=${BATCHD_REDIS_URL:-redis://127.0.0.1:6379/0}
cli() { redis-cli -u "$url" --no-auth-warning "$@"; }

# 1. Make the job id yourself, so you could listen before you submit.
id=$(cat /proc/sys/kernel/random/uuid 2>/dev/null || uuidgen)
job=$(jq -cn --arg id "$id" --arg prompt "$prompt" \
    '{id: $id, messages: [{role: "user", content: $prompt}], max_tokens: 64}')

# 2. Submit once: the status hash (state queued, queue, queued_at) only if the id is new,
#    and the queue entry with it, in one script. A refused XADD takes the hash back out.
submit='
if redis.call("EXISTS", KEYS[1]) == 1 then return 0 end
redis.call("HSET", KEYS[1], "state", "queued", "queue", ARGV[1], "queued_at", ARGV[2])
local added = redis.pcall("XADD", KEYS[2], "*", "job", ARGV[3])
if type(added) == "table" and added.err then redis.call("DEL", KEYS[1]); return added end
return 1'
created=$(cli EVAL "$submit" 2 "batchd:job:$id" "batchd:queue:$queue" "$queue" "$(date +%s)" "$job")
if [ "$created" != 1 ]; then
    echo "job $id not submitted: $created" >&2
    exit 1
fi
echo "job $id" >&2

# 3. Read the events stream from the start (not only the Pub/Sub channel): every event
#    once, in order, also after a reconnect. With --raw, XREAD prints the stream's name,
#    then each entry's id, field name ("event") and value (the event's JSON) on a line each.
last=0-0
while :; do
    reply=$(cli --raw XREAD BLOCK 10000 STREAMS "batchd:job:$id:events" "$last")
    if [ -z "$reply" ]; then
        # Nothing for 10 s. A job refused at pickup (dead-lettered) has no events, only
        # its status hash: check it when nothing comes.
        state=$(cli HGET "batchd:job:$id" state)
        if [ "$state" = failed ] || [ "$state" = expired ] || [ "$state" = cancelled ]; then
            echo "job $id $state: $(cli HGET "batchd:job:$id" error)" >&2
            exit 1
        fi
        continue
    fi
    {
        read -r _stream
        while read -r entry && read -r _field && read -r event; do
            last=$entry
            finish=$(jq -r '.finish_reason // empty' <<<"$event")
            if [ -z "$finish" ]; then
                jq -j '.text' <<<"$event" # a token event: print its text as it comes
                continue
            fi
            # The final event repeats the whole text, with usage and timings.
            echo
            echo "finish_reason: $finish $(jq -c '.usage' <<<"$event")" >&2
            case $finish in
            stop | length) exit 0 ;;
            *) echo "error: $(jq -r '.error // empty' <<<"$event")" >&2 && exit 1 ;;
            esac
        done
    } <<<"$reply"
done
