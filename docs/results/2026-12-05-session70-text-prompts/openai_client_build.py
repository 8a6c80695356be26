import asyncio, time, openai, json
import httpx2 as httpx
def handler(request):
    return httpx.Response(200, json={"id":"x","object":"text_completion","created":0,"model":"m","choices":[{"index":0,"text":"a","finish_reason":"stop","logprobs":None}]})
async def main():
    http = openai.DefaultAsyncHttpxClient(transport=httpx.MockTransport(handler))
    c = openai.AsyncOpenAI(base_url="http://x/v1", api_key="k", http_client=http, max_retries=0)
    ids = list(range(1000, 1700))
    text = " ".join(["hello"]*700)
    for name, p in [("ids", ids), ("text", text), ("ids", ids), ("text", text)]:
        t = time.perf_counter(); n=50
        for i in range(n):
            await c.completions.create(model="m", prompt=p, max_tokens=8, temperature=0.7, top_p=0.8, extra_body={"top_k":20,"ignore_eos":True})
        print(name, (time.perf_counter()-t)/n*1e3, "ms")
asyncio.run(main())
