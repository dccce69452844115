from pagedllm.outputs import Logprob, PromptLogprobs, SampleLogprobs  # noqa: F401
