"""Offline generation with the embedded SmolLM2-135M-Instruct: vLLM's example, jllm import.

Run with `make demo` (or `python examples/offline_inference.py`).
"""

from jllm import LLM, SamplingParams


def main() -> None:
    llm = LLM()  # no model: the embedded SmolLM2-135M-Instruct GGUF
    tokenizer = llm.get_tokenizer()
    sampling_params = SamplingParams(
        temperature=0.7, top_p=0.8, repetition_penalty=1.05, max_tokens=512
    )
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain in two sentences what a KV cache is.",
        "Give me three tips for learning a new language.",
    ]
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in questions
    ]
    outputs = llm.generate(texts, sampling_params)
    for question, output in zip(questions, outputs, strict=True):
        print(f"Prompt: {question!r}\nGenerated text: {output.outputs[0].text!r}\n")


if __name__ == "__main__":
    main()
