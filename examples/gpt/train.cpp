// Trains the character-level GPT of gpt.cppm on the fortune cookie corpus (Debian's `fortunes`)
// with the shared remat trainer, then prints a generated sample.
import remat.trainer;
import gpt;
import gpt.kernels;
import remat;

// Known at compile time: selective saves less than none, full less than selective.
static_assert(remat::make_plan(gpt::model, remat::selective, gpt::default_batch).activation_bytes <
              remat::make_plan(gpt::model, remat::none, gpt::default_batch).activation_bytes);
static_assert(remat::make_plan(gpt::model, remat::full, gpt::default_batch).activation_bytes <
              remat::make_plan(gpt::model, remat::selective, gpt::default_batch).activation_bytes);

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
