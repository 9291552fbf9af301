// Trains the residual MLP of mlp.cppm on Fashion-MNIST with the shared remat trainer.
import remat.trainer;
import mlp;
import mlp.kernels;
import remat;

// The plan is known at compile time: activation memory under this policy at the default batch.
static_assert(remat::make_plan(mlp::model, mlp::policy, mlp::default_batch).activation_bytes <
              remat::make_plan(mlp::model, remat::none, mlp::default_batch).activation_bytes / 4);

int main(int argc, char **argv) {
  return remat::runtime::train_main(argc, argv,
                                    {.name = "mlp",
                                     .model = mlp::model,
                                     .default_policy = mlp::policy,
                                     .kernels = mlp_kernels::table,
                                     .cuda_kernels = mlp_kernels::cuda_table,
                                     .data = remat::runtime::fashion_mnist,
                                     .default_data_dir = "/usr/share/datasets/fashion-mnist",
                                     .default_batch = mlp::default_batch,
                                     .default_epochs = 6,
                                     .default_learning_rate = 2e-3,
                                     .default_warmup_steps = 200});
}
