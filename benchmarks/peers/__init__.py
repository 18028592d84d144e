"""Rows 10 of the benchmark: our recipe vs what a user would run instead to train the same
adapter jobs: transformers + peft, one process training the adapters one after another (1 or 2
threads), or independent peft processes at once over the same cores.

Every way trains conf/jobs/demo4.yaml's jobs (rank, alpha, dropout, lr, warmup, schedule,
global batch, grad clip, weight decay) for the same number of steps on the same data, written
by scripts/make_demo_data.py (the tiny random HF Llama and the letter tasks):

* ours: ``mmlora train --nproc 2`` (torchrun and the recipe) with OMP_NUM_THREADS=1, as a
  user launches it (scripts/demo.sh --tiny), with evaluation during
  training and intermediate checkpoints off (``trainer.eval_interval=0
  checkpoint.save_interval=0``), a metrics record every step (``trainer.log_interval=1``);
* peft: ``python -m benchmarks.peers.worker --peft-worker ...`` (:mod:`.peft_loop`; it
  imports no megatron), a plain loop over ``AutoModelForCausalLM`` +
  ``peft.get_peft_model`` with LoRA on the HF modules our targets map to (q/k/v/o, gate/up/
  down), torch AdamW and our LR schedule (``slot_optimizer.lr_factor``), the same token ids and
  loss masks (``datasets.load_dataset`` with the HF tokenizer, as the recipe's), the same sample
  order (``Job.next_samples`` with the run's seed), labels -100 outside the completion, so
  the loss is the mean over the job's loss tokens in its global batch, like ours.

Held-out loss: the mean over the loss tokens of the first ``trainer.eval_samples`` records of
each job's eval file (ours: its end-of-run adapter x task table; peft: the same examples
through the PEFT model).
"""
