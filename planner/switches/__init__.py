"""One switch per trainer: Hugging Face ``Trainer`` (`hf_trainer`), 🤗 accelerate
(`hf_accelerate`), Lightning (`lightning`) and torchtitan (`torchtitan`), each planning the
step its trainer runs; `loader` finds the first batch a trainer's data loader gives."""
