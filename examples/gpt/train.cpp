// Trains the character-level GPT of gpt.cppm on the fortune cookie corpus (Debian's `fortunes`)
// with the shared remat trainer, then prints a generated sample.
import remat.runtime;
import gpt;
import gpt.kernels;

int main(int argc, char **argv) {
  return remat::runtime::train_main(argc, argv,
                                    {.name = "gpt",
                                     .model = gpt::model,
                                     .default_policy = gpt::policy,
                                     .kernels = gpt_kernels::table,
                                     .cuda_kernels = gpt_kernels::cuda_table,
                                     .data = remat::runtime::text_corpus,
                                     .default_data_dir = "/usr/share/games/fortunes",
                                     .default_batch = gpt::default_batch,
                                     .default_max_steps = 1500,
                                     .default_learning_rate = 2e-3,
                                     .default_warmup_steps = 100,
                                     .default_eval_samples = 256,
                                     .default_eval_steps = 250,
                                     .sample_length = 400});
}
