"""The Responses API (`/v1/responses`) through the official SDK on the tiny random-weight model:
output items and usage, retrieval of a stored response, the streamed event sequence as the SDK's
own accumulator checks it, `previous_response_id` continuing a stored conversation from the
prefix cache, function tools and their outputs, structured output parsed into a Pydantic model,
and clear errors. Thinking is off (`reasoning.effort: none`) where the answer's form matters:
the random model's reasoning never ends."""

import openai
import pytest
from pydantic import BaseModel, Field

NO_THINKING = {"effort": "none"}


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=150)


WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"], "additionalProperties": False}, "strict": True}


def test_create_and_retrieve(client):
    r = client.responses.create(model="lily", instructions="Be brief.", input="Say something.", max_output_tokens=12, temperature=0, reasoning=NO_THINKING)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status in ("completed", "incomplete")
    assert r.status != "incomplete" or r.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in r.output] == ["message"]
    assert isinstance(r.output_text, str) and r.output_text == r.output[0].content[0].text
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 12
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "Be brief." and r.max_output_tokens == 12
    again = client.responses.retrieve(r.id)
    assert again.id == r.id and again.output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="lily", previous_response_id=r.id, input="x")
    # store=false keeps nothing.
    gone = client.responses.create(model="lily", input="x", max_output_tokens=2, store=False, reasoning=NO_THINKING)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)


def test_reasoning_comes_as_a_reasoning_item(client):
    r = client.responses.create(model="lily", input="Think first.", max_output_tokens=10, temperature=0)
    # Thinking on: the random model's reasoning fills the budget.
    assert r.output[0].type == "reasoning" and r.output[0].content[0].text
    assert r.status == "incomplete"


def test_stream_events_accumulate_to_the_final_response(client):
    deltas, types, seqs = [], [], []
    # The SDK's stream helper checks every event against its accumulated snapshot as it goes.
    with client.responses.stream(model="lily", input="Tell me a story.", max_output_tokens=16, temperature=0, reasoning=NO_THINKING) as stream:
        for ev in stream:
            types.append(ev.type)
            seqs.append(ev.sequence_number)
            if ev.type == "response.output_text.delta":
                deltas.append(ev.delta)
    # Cut by max_output_tokens, the last event is response.incomplete with the whole response
    # (the helper's get_final_response() waits for response.completed only).
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.incomplete"
    final = ev.response
    assert final.status == "incomplete" and final.usage.output_tokens == 16
    assert seqs == list(range(len(seqs)))
    assert "response.output_item.added" in types and "response.output_item.done" in types
    assert final.output_text == "".join(deltas)
    # The same greedy request, not streamed, says the same.
    r = client.responses.create(model="lily", input="Tell me a story.", max_output_tokens=16, temperature=0, reasoning=NO_THINKING)
    assert r.output_text == final.output_text


def test_previous_response_id_continues_from_the_cache(client):
    doc = " ".join(f"word{i}" for i in range(100))
    first = client.responses.create(model="lily", input=f"Read this: {doc}", max_output_tokens=8, temperature=0, reasoning=NO_THINKING)
    second = client.responses.create(model="lily", previous_response_id=first.id, input="And now?", max_output_tokens=8, temperature=0, reasoning=NO_THINKING)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens
    # Only the new turn (and the re-rendered answer) is prefilled.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 8, second.usage
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="lily", previous_response_id="resp_nope", input="x")
    assert "resp_nope" in str(e.value)


def test_function_tools_and_their_outputs(client):
    r = client.responses.create(model="lily", input="Weather in Paris?", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60, temperature=0.7, reasoning=NO_THINKING)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather", r.output
    assert calls[0].call_id and isinstance(calls[0].arguments, str)
    # As in OpenAI's API, tools are sent again with each request (they render into the prompt).
    follow = client.responses.create(
        model="lily",
        previous_response_id=r.id,
        tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}],
        max_output_tokens=8,
        temperature=0,
        reasoning=NO_THINKING,
    )
    assert follow.status in ("completed", "incomplete")
    assert follow.usage.input_tokens_details.cached_tokens > 0


def test_structured_output_parses(client):
    r = client.responses.parse(model="lily", input="Describe someone.", text_format=Person, max_output_tokens=200, temperature=0.7, reasoning=NO_THINKING)
    assert isinstance(r.output_parsed, Person), r.output_text
    # Streamed, the constrained answer completes and the helper parses it.
    with client.responses.stream(model="lily", input="Describe someone.", text_format=Person, max_output_tokens=200, temperature=0.7, extra_body={"seed": 4}, reasoning=NO_THINKING) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and isinstance(final.output_parsed, Person), final.output_text


def test_errors_are_clear(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="lily", input="x", tools=[{"type": "web_search"}])
    assert "function tools only" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="lily", input=[{"role": "user", "content": [{"type": "input_image", "image_url": "data:"}]}])
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_missing")
